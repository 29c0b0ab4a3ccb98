"""The `aserve --help` text of every engine flag: one line per `EngineArgs` field (`ENGINE_HELP`; a
field without one fails the parser's construction, so a new field cannot go undescribed) and the
default shown where the field's own default (often None) is resolved later (`ENGINE_DEFAULTS`)."""

from __future__ import annotations

from aserve.config import BUNDLED_MODEL_NAME
from aserve.config.engine_args import LOAD_FORMATS
from aserve.config.resolve import _DEFAULT_TOKEN_BUDGET

ENGINE_HELP = {
    "model": "model name, Hugging Face folder or .gguf file",
    "served_model_name": "the model name(s) the API answers to",
    "max_model_len": "context length",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "max_num_seqs": "maximum requests in one batch",
    "max_num_batched_tokens": "token budget per engine step",
    "dtype": "weight/activation dtype: auto, half, float16, bfloat16, float, float32",
    "kv_cache_dtype": "KV-cache dtype: auto, fp8, fp8_e4m3, fp8_e5m2",
    "quantization_param_path": "fp8 KV cache: a JSON of per-layer scales (vLLM's format: kv_cache.scaling_factor, "
                               "tensor-parallel rank -> layer -> scale for K and V); needs --kv-cache-dtype fp8",
    "calculate_kv_scales": "fp8 KV cache: compute each layer's K and V scales from the first batch (amax over "
                           "the fp8 maximum), then keep them; needs --kv-cache-dtype fp8",
    "num_gpu_blocks_override": "use this many KV blocks instead of profiling",
    "distributed_executor_backend": "where the model runner lives: uni (a thread) or mp (a process per "
                                    "tensor-parallel rank; the default with -tp > 1); ray is not implemented",
    "disable_async_output_proc": "do not overlap output processing with the next step (--no-disable-async-output-proc: "
                                 "overlap it, also on CPU)",
    "enable_sleep_mode": "serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping: release the KV "
                         "cache (level 2: the weights too) while idle",
    "enforce_eager": "never capture CUDA graphs (the same as -O0)",
    "compilation_config": "-O / -O3: a compilation level (0 eager, 3 compiled: CUDA graphs on CUDA, an "
                          "inductor-compiled decode on CPU) or a JSON object {\"level\": 3, \"compile_sizes\": [1]}",
    "hf_overrides": "JSON object merged into the model's config.json",
    "rope_scaling": 'JSON object, e.g. \'{"rope_type": "linear", "factor": 2.0}\'',
    "disable_log_stats": "no periodic stats log line",
    "tensor_parallel_size": "tensor-parallel degree: split each layer across this many worker processes "
                            "(one per rank, mp backend; gloo on CPU, NCCL on CUDA)",
    "pipeline_parallel_size": "pipeline-parallel degree: split the layers into this many stages, one worker per "
                              "stage (x --tensor-parallel-size), one step per stage in flight",
    "data_parallel_size": "engine replicas behind one server, each with its own workers and KV cache; requests "
                          "go to the least loaded one, or to the one holding their prompt's prefix",
    "data_parallel_rank": "which replica this engine is (aserve sets it for each replica; on CUDA replica r uses "
                          "devices r*tp .. r*tp+tp-1)",
    "guided_decoding_backend": "grammar engine for structured outputs: auto, xgrammar or guidance "
    "(a request's guided_decoding_backend overrides it), with vLLM's options after a colon for every request: "
    "disable-any-whitespace, disable-additional-properties, no-fallback (e.g. xgrammar:disable-any-whitespace)",
    "structured_outputs_config": 'vLLM\'s newer spelling, a JSON object: backend, disable_any_whitespace, '
    'disable_additional_properties, disable_fallback, reasoning_parser (= --reasoning-parser), e.g. '
    '\'{"backend": "xgrammar", "disable_any_whitespace": true}\'',
    "model_impl": "auto: aserve's native class when there is one, else the Transformers backend; aserve: native "
                  "only; transformers: always transformers' modeling code with aserve's paged attention",
    "tokenizer": "tokenizer name or folder",
    "tokenizer_mode": "auto (the fast tokenizer) or slow (transformers' Python tokenizer, when the model has one)",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs carry token ids only",
    "revision": "Hub revision (branch, tag or commit) of the model",
    "tokenizer_revision": "Hub revision of the tokenizer",
    "trust_remote_code": "accept models whose config asks for remote code (aserve runs none: it uses its native "
                         "classes or the Transformers backend)",
    "download_dir": "where Hub downloads go",
    "load_format": f"weight file format: {', '.join(LOAD_FORMATS)} (dummy: random weights; npcache: numpy copies "
                   "cached on the first load and memory-mapped afterwards; tensorizer: a .tensors file named by "
                   "--model-loader-extra-config's tensorizer_uri)",
    "seed": "random seed of sampling",
    "swap_space": "CPU swap space per GPU in GiB (used by --preemption-mode swap)",
    "cpu_offload_gb": "CUDA: GiB of weights (whole decoder layers) kept in pinned CPU memory and streamed to the "
                      "GPU each forward pass (turns CUDA graphs off; refused on CPU)",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and the KV cache",
    "cpu_kvcache_space": "KV-cache size in GiB on CPU",
    "max_logprobs": "the most logprobs a request may ask for",
    "max_seq_len_to_capture": "longest sequence CUDA graphs cover; longer ones run eager",
    "enable_chunked_prefill": "split long prompts into chunks of the --max-num-batched-tokens budget",
    "preemption_mode": "what frees KV blocks when the cache is full: recompute or swap",
    "scheduling_policy": "fcfs, or priority (by the request's priority field)",
    "rope_theta": "RoPE base (overrides the model's)",
    "generation_config": "sampling defaults: auto (the model's generation_config.json), vllm (none) or a folder "
                         "holding generation_config.json",
    "device": "auto, cpu or cuda (auto: cuda when available)",
    "attention_backend": "attention kernels: torch or triton",
    "quantization": "weight quantization: int8 (weight_only_int8) / int4 / fp8 / bitsandbytes (quantized at "
                    "load), gguf, or a quantized checkpoint's format (gptq, awq, compressed-tensors, fp8, "
                    "bitsandbytes; smooth_quant: a compressed-tensors W8A8 checkpoint)",
    "disable_sliding_window": "full attention instead of the model's sliding window",
    "override_generation_config": "JSON object of generation_config.json keys (temperature, top_p, top_k, min_p, "
                                  "repetition_penalty, max_new_tokens) over the --generation-config defaults",
    "hf_config_path": "a folder whose config.json is read instead of the model's",
    "config_format": "auto or hf: Hugging Face config.json (mistral's params.json is refused)",
    "ignore_patterns": "weight files to skip (fnmatch globs inside the model folder; also not downloaded)",
    "code_revision": "Hub revision of the model's remote code (refused with --trust-remote-code)",
    "model_loader_extra_config": "JSON object of loader options: enable_multithread_load / num_threads (files "
                                 "read on threads); tensorizer_uri / num_readers / verify_hash (--load-format "
                                 "tensorizer)",
    "max_parallel_loading_workers": "with tensor parallelism, at most this many ranks read weights at once",
    "kv_cache_memory_bytes": "KV-cache size in bytes (beats the --gpu-memory-utilization sizing)",
    "tokenizer_pool_size": "threads that tokenize and render chat templates, each with its own tokenizer copy "
                           "(0 or 1: one), so long prompts do not queue behind one another",
    "tokenizer_pool_type": "'thread' (vLLM's 'ray' is refused: aserve's pool runs threads)",
    "tokenizer_pool_extra_config": "refused when set: the thread pool takes no options",
    "logits_processor_pattern": "a regex: requests may name logits processors (qualified names matching it) in "
                                "logits_processors; none by default",
    "enable_lora": "serve LoRA adapters (--lora-modules, or loaded at run time)",
    "enable_lora_bias": "accept adapters whose lora_B has a bias",
    "max_loras": "the most adapters active in one batch (more wait for a free slot)",
    "max_lora_rank": "the largest adapter rank accepted",
    "max_cpu_loras": "adapters kept loaded in host memory (least recently used evicted)",
    "lora_dtype": "dtype of the LoRA weights: auto (the model's), float16, bfloat16, float32",
    "lora_extra_vocab_size": "extra vocabulary an adapter may add (adapters adding tokens are refused)",
    "fully_sharded_loras": "shard both LoRA matmuls across tensor-parallel ranks (no-op with one rank; refused with more)",
    "long_lora_scaling_factors": "LongLoRA scaling factors (refused: LongLoRA is not implemented)",
    "qlora_adapter_name_or_path": "a QLoRA adapter over a bitsandbytes base (refused: not implemented)",
    "scheduler_delay_factor": "while requests run, admit new prompts only after factor x the last prompt step's "
                              "latency (batches arrivals into fewer prefill steps)",
    "max_num_partial_prefills": "prefills whose chunk does not finish their prompt, per step",
    "max_long_partial_prefills": "of those, how many may be long (over --long-prefill-token-threshold), so "
                                 "short prompts get through while long ones prefill",
    "long_prefill_token_threshold": "a prompt longer than this is long; each prefill chunk is capped at it",
    "scheduler_cls": "a Scheduler subclass by dotted path (package.module.Class), checked at start-up",
    "num_scheduler_steps": "multi-step decode: when every scheduled request is decoding, run up to N decode "
                           "steps per scheduling call (fewer scheduler and IPC round trips per token)",
    "multi_step_stream_outputs": "stream each decode step's tokens as it runs (--no-multi-step-stream-outputs: "
                                 "all of a multi-step call's tokens at its end)",
    "async_scheduling": "schedule the next step while the current one runs, so the runner never waits for the "
                        "scheduler (a decoding request's next input is the token the runner just sampled; "
                        "--no-async-scheduling: one step at a time)",
    "task": "what the model serves: auto, generate, embed (alias embedding), classify, score (a cross-encoder) "
            "or encode (raw pooled states)",
    "runner": "auto, generate or pooling (pooling serves any supported causal family as a last-token embedder)",
    "override_pooler_config": 'JSON object over the model\'s pooling: pooling_type (LAST, MEAN, CLS, ALL), '
                              "normalize, softmax, dimensions (alias --pooler-config)",
    "speculative_config": 'speculative decoding, a JSON object with vLLM\'s keys: method (ngram or draft_model), '
                          "num_speculative_tokens, prompt_lookup_max/min (ngram), model (a draft sharing the "
                          "vocabulary), max_model_len, disable_by_batch_size, acceptance_method, disable_logprobs; "
                          'e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    "num_lookahead_slots": "KV slots reserved past each request's scheduled tokens (at least a draft model's "
                           "num_speculative_tokens)",
    "otlp_traces_endpoint": "send an OpenTelemetry span (llm_request) per request to this OTLP endpoint: "
                            "http(s)://host:4318[/v1/traces] is OTLP/HTTP, grpc://host:4317 or host:4317 OTLP/gRPC "
                            "($OTEL_EXPORTER_OTLP_TRACES_PROTOCOL overrides); needs pip install 'aserve[otel]'",
    "collect_detailed_traces": "add per-request model timings to the spans: model (time in the forward pass), "
                               "worker (time in the executor's step), all; comma-separated; needs "
                               "--otlp-traces-endpoint",
}
# The default shown when the field's own default (often None) is resolved later (aserve/config/resolve.py).
ENGINE_DEFAULTS = {
    "disable_async_output_proc": "on CPU, off elsewhere",
    "async_scheduling": "on with a worker process (the server's mp executor, ray) unless speculative decoding, "
                        "multi-step decode or pipeline parallelism is asked for; off with uni",
    "model": f"'', the bundled {BUNDLED_MODEL_NAME}",
    "tokenizer": "the --model",
    "max_model_len": "from the model's config.json",
    "served_model_name": "the --model name",
    "download_dir": "the Hugging Face cache",
    "cpu_kvcache_space": "$ASERVE_CPU_KVCACHE_SPACE, else $VLLM_CPU_KVCACHE_SPACE, else 4",
    "max_num_batched_tokens": f"{_DEFAULT_TOKEN_BUDGET['cpu']} on CPU, {_DEFAULT_TOKEN_BUDGET['cuda']} on CUDA; "
                              "without chunked prefill at least --max-model-len",
    "enable_chunked_prefill": "True",
    "preemption_mode": "'recompute'",
    "rope_theta": "the model's",
    "distributed_executor_backend": "'uni' offline, 'mp' for the server and with -tp > 1 ('ray' when the ranks "
                                    "outnumber the local GPUs and Ray is installed)",
    "attention_backend": "'triton' on CUDA, 'torch' on CPU",
    "compilation_config": "level 3 on CUDA (CUDA graphs), 0 (eager) on CPU",
    "quantization": "the checkpoint's own quantization_config, if any (a float checkpoint: none; "
                    "--load-format bitsandbytes: bitsandbytes)",
    "hf_overrides": "{}: config.json as it is",
    "rope_scaling": "None: the model's",
    "override_generation_config": "{}: no overrides",
    "hf_config_path": "None: the model's config.json",
    "kv_cache_memory_bytes": "None: sized by --gpu-memory-utilization / --cpu-kvcache-space",
    "num_gpu_blocks_override": "None: as many as fit",
    "structured_outputs_config": "None: --guided-decoding-backend",
    "revision": "None: the latest",
    "tokenizer_revision": "None: the latest",
    "code_revision": "None: the latest",
    "model_loader_extra_config": "None: one thread; tensorizer needs tensorizer_uri",
    "max_parallel_loading_workers": "None: every rank at once",
    "max_cpu_loras": "None: --max-loras",
    "long_prefill_token_threshold": "0: no cap (4%% of --max-model-len with --max-num-partial-prefills > 1)",
    "scheduler_cls": "None: aserve.core.scheduler.Scheduler (vLLM's default names mean the same)",
    "task": "'auto': generate for causal LMs, embed (classify for a classifier head) for encoders",
    "override_pooler_config": "None: the model's (sentence-transformers files, else the architecture's)",
    "speculative_config": "None: no speculative decoding",
}
