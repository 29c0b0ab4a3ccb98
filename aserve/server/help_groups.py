"""`aserve --help` grouped by topic, as vLLM groups its flags (ModelConfig, LoadConfig, ...), and
`--help=<group>` (one group), `--help=listgroup` (the group names) or `--help=<word>` (the flags whose
name holds it).

`regroup(parser)` moves every flag of the finished parser into its topic's argument group, by `dest`:
`FLAG_GROUPS` names the group of every engine, server and vLLM-compat flag (tests/server/test_help.py
checks none is missing).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# (key, vLLM's config class, what the group holds); --help=<key> or --help=<vLLM name> prints one.
GROUPS: tuple[tuple[str, str, str], ...] = (
    ("model", "ModelConfig", "the model, its tokenizer, its config.json and sampling defaults"),
    ("load", "LoadConfig", "reading the weights"),
    ("cache", "CacheConfig", "the paged KV cache"),
    ("scheduler", "SchedulerConfig", "batching, chunked prefill and preemption"),
    ("parallel", "ParallelConfig", "tensor, pipeline and data parallelism"),
    ("device", "DeviceConfig", "the device and its kernels"),
    ("compilation", "CompilationConfig", "CUDA graphs and torch.compile"),
    ("decoding", "DecodingConfig", "structured outputs (guided decoding)"),
    ("lora", "LoRAConfig", "LoRA adapters (prompt adapters: refused)"),
    ("speculative", "SpeculativeConfig", "speculative decoding: n-gram prompt lookup or a draft model"),
    ("observability", "ObservabilityConfig", "logging, stats and tracing"),
    ("server", "Frontend", "the HTTP server: address, TLS, CORS, API keys, chat templates, limits"),
    ("tools", "Frontend", "tool calling and reasoning parsers"),
)

_G = {
    "model": """model tokenizer tokenizer_mode skip_tokenizer_init revision tokenizer_revision trust_remote_code
        dtype max_model_len seed max_logprobs rope_scaling rope_theta hf_overrides generation_config
        served_model_name quantization disable_sliding_window model_impl override_generation_config
        hf_config_path config_format code_revision
        runner task override_pooler_config pooler_config image_input_type image_token_id image_input_shape image_feature_size
        image_processor image_processor_revision disable_image_processor limit_mm_per_prompt mm_processor_kwargs
        disable_mm_preprocessor_cache allowed_local_media_path tokenizer_extension_path multi_query_mode
        tokenizer_pool_size tokenizer_pool_type tokenizer_pool_extra_config logits_processor_pattern
        quantization_param_path enable_sleep_mode""",
    "load": "download_dir load_format ignore_patterns model_loader_extra_config use_tqdm_on_load",
    "cache": """kv_cache_dtype block_size enable_prefix_caching swap_space cpu_offload_gb gpu_memory_utilization
        num_gpu_blocks_override cpu_kvcache_space kv_cache_memory_bytes use_v2_block_manager
        forced_num_gpu_blocks calculate_kv_scales kv_transfer_config""",
    "scheduler": """max_num_batched_tokens max_num_seqs enable_chunked_prefill preemption_mode scheduling_policy
        disable_async_output_proc max_paddings scheduler_delay_factor max_num_partial_prefills
        max_long_partial_prefills long_prefill_token_threshold num_scheduler_steps multi_step_stream_outputs
        async_scheduling
        num_lookahead_slots scheduler_cls""",
    "parallel": """distributed_executor_backend tensor_parallel_size pipeline_parallel_size data_parallel_size
        data_parallel_rank disable_custom_all_reduce worker_use_ray ray_workers_use_nsight engine_use_ray enable_expert_parallel
        worker_cls worker_extension_cls max_parallel_loading_workers""",
    "device": "device attention_backend override_neuron_config additional_config",
    "compilation": "compilation_config enforce_eager max_seq_len_to_capture max_context_len_to_capture",
    "decoding": "guided_decoding_backend structured_outputs_config",
    "lora": """enable_lora enable_lora_bias max_loras max_lora_rank fully_sharded_loras max_cpu_loras lora_dtype
        lora_extra_vocab_size long_lora_scaling_factors qlora_adapter_name_or_path lora_modules
        enable_prompt_adapter max_prompt_adapters max_prompt_adapter_token""",
    "speculative": """speculative_model speculative_model_quantization num_speculative_tokens
        speculative_draft_tensor_parallel_size speculative_max_model_len speculative_disable_by_batch_size
        ngram_prompt_lookup_max ngram_prompt_lookup_min spec_decoding_acceptance_method
        typical_acceptance_sampler_posterior_threshold typical_acceptance_sampler_posterior_alpha
        disable_logprobs_during_spec_decoding speculative_disable_mqa_scorer speculative_config""",
    "observability": """disable_log_stats stats_log_interval log_level uvicorn_log_level disable_log_requests
        enable_log_requests max_log_len show_hidden_metrics_for_version otlp_traces_endpoint
        collect_detailed_traces metrics_prefix""",
    "server": """host port api_key chat_template chat_template_content_format response_role allowed_origins
        allowed_methods allowed_headers allow_credentials root_path ssl_keyfile ssl_certfile ssl_ca_certs
        ssl_cert_reqs shutdown_grace_period max_num_queued_reqs max_num_queued_tokens max_request_body_bytes
        request_timeout middleware enable_prompt_tokens_details""",
    "tools": "enable_auto_tool_choice tool_call_parser enable_reasoning reasoning_parser",
}
FLAG_GROUPS: dict[str, str] = {dest: key for key, names in _G.items() for dest in names.split()}
_UNGROUPED = {"help", "version", "model_tag"}  # stay where argparse puts them


def group_title(key: str) -> str:
    vllm_name = next(v for k, v, _ in GROUPS if k == key)
    return f"{key} ({vllm_name})"


def regroup(parser: argparse.ArgumentParser) -> None:
    """Move every flag into its topic's argument group (in `GROUPS` order), dropping the groups the
    flags were added to. A flag missing from `FLAG_GROUPS` lands in an 'other' group."""
    actions = [a for g in parser._action_groups for a in g._group_actions]
    parser._action_groups = [g for g in parser._action_groups if g.title in ("positional arguments", "options",
                                                                            "optional arguments")]
    for g in parser._action_groups:
        g._group_actions[:] = [a for a in g._group_actions if a.dest in _UNGROUPED]
    groups = {key: parser.add_argument_group(group_title(key), description) for key, _, description in GROUPS}
    for action in actions:
        if action.dest in _UNGROUPED:
            continue
        key = FLAG_GROUPS.get(action.dest)
        if key is None:
            groups.setdefault("other", parser.add_argument_group("other"))
            key = "other"
        groups[key]._group_actions.append(action)


def _find_group(parser: argparse.ArgumentParser, name: str) -> Any:
    wanted = name.lower()
    for key, vllm_name, _ in GROUPS:
        if wanted in (key, vllm_name.lower()) and (wanted != "frontend" or key == "server"):
            return next(g for g in parser._action_groups if g.title == group_title(key))
    return None


def format_help_for(parser: argparse.ArgumentParser, name: str) -> str | None:
    """The help text `--help=<name>` prints; None when `name` is neither a group nor part of a flag."""
    if name.lower() == "listgroup":
        width = max(len(k) for k, _, _ in GROUPS)
        lines = [f"  {k:<{width}}  {v:<19} {d}" for k, v, d in GROUPS]
        return ("groups (aserve --help=<group>; vLLM's class names work too):\n" + "\n".join(lines) + "\n")
    formatter = parser._get_formatter()
    group = _find_group(parser, name)
    if group is not None:
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(group._group_actions)
        formatter.end_section()
        return formatter.format_help()
    word = name.lower().lstrip("-").replace("_", "-")
    matches = [a for g in parser._action_groups for a in g._group_actions
               if a.dest not in _UNGROUPED and any(word in s.lstrip("-") for s in a.option_strings)]
    if not matches:
        return None
    formatter.start_section(f"flags matching {name!r}")
    formatter.add_arguments(matches)
    formatter.end_section()
    return formatter.format_help()


class HelpAction(argparse.Action):
    """-h / --help: the whole help; --help=<group>: one group; --help=listgroup: the group names;
    --help=<word>: the flags whose name holds `word`."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs="?", metavar="GROUP",
                         help="show this help and exit; --help=<group> shows one group of flags, "
                              "--help=listgroup lists the groups, --help=<word> the flags whose name holds it")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values is None:
            parser.print_help()
            parser.exit()
        text = format_help_for(parser, values)
        if text is None:
            parser.error(f"--help={values}: no such group or flag; groups: "
                         f"{', '.join(k for k, _, _ in GROUPS)} (or --help=listgroup)")
        sys.stdout.write(text)
        parser.exit()
