"""Names of the architectures aserve implements natively (plain strings, so config needs no torch)."""

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
