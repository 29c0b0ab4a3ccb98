"""`aserve bench serve | throughput | latency`: vLLM's benchmark commands, for any server or aserve.LLM.

- `datasets`: seeded workloads (vLLM's random token-id prompts, ShareGPT, the synthetic word prompts).
- `client`: one streaming OpenAI request (completions or chat) timed per chunk; imports nothing from aserve.
- `metrics`: arrival times (gamma, vLLM's burstiness), percentiles and the result JSON in vLLM's names.
- `serve`: the async load generator and its flags; `plot`: the concurrency-sweep PNG (matplotlib).
- `offline`: `throughput` and `latency` over `aserve.LLM`; `cli`: the subcommand dispatch.
"""
