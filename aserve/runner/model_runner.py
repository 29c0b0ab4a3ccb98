"""The model runner: owns the model, the KV cache tensors and the sampler.

`load_model()` -> `initialize_kv_cache()` (sizes the pool: CPU budget, GPU profiling, or the
override) -> `capture_graphs()` (CUDA graphs; on CPU with -O3 the inductor-compiled decode) ->
`execute(SchedulerOutput) -> RunnerOutput` per step.
It never decides policy: it runs what the scheduler emitted and trusts its input (intake validated it).

Guided requests (structured outputs) keep a grammar state in `runner/structured.py`; the step's
bitmask is filled on a helper thread while the forward pass runs and applied in the sampler.

Failures: what can be pinned on one request (its sampling state or grammar, its logits processors, its
grammar rejecting the sampled token) fails that request alone: its state is dropped, it is left out of the
step's sampling and reported in `RunnerOutput.failed_requests`. Anything else `execute` raises is fatal.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from aserve.config import AserveConfig, GiB
from aserve.config.parallel import rank_arch_config, stage_arch_config
from aserve.core.batch import CachedRequestData, NewRequestData, RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.distributed.collectives import all_reduce_min
from aserve.distributed.context import SINGLE, ParallelContext
from aserve.lora import LoRAAdapterError, LoRARequest
from aserve.model.attention import make_attention_backend
from aserve.model.forward_context import ForwardContext, set_forward_context
from aserve.model.loader import kv_cache_dtype_for, load_model, torch_dtype
from aserve.model.weight_offload import offload_weights
from aserve.runner.compiled_decode import CompiledDecode
from aserve.runner.cpu_decode_step import CpuDecodeStep
from aserve.runner.cuda_graphs import CudaGraphRunner, capture_sizes, padded_size
from aserve.runner.graph_capture import capture_decode
from aserve.runner.input_batch import CachedRequestState, ModelInputs, build_model_inputs
from aserve.runner.kv_memory import copy_blocks, profile_num_blocks, run_profile_step, zeroed
from aserve.runner.sampling import Sampler, compute_prompt_logprobs
from aserve.runner.kv_scales_step import KVScaleCalculation
from aserve.runner.multi_step import run_later_decode_steps
from aserve.runner.pipeline_stage import PipelineStage, unsampled
from aserve.runner.sleep_mode import RunnerSleep
from aserve.runner.spec_decode import make_proposer, make_typical_acceptance
from aserve.runner.step_sampling import StepSamples, StepSampler
from aserve.runner.structured import StructuredOutputs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: AserveConfig, force_static_decode: bool = False, parallel: ParallelContext = SINGLE):
        """`force_static_decode` pads decode batches to capture sizes even without graphs (tests).
        `parallel`: this rank of a tensor-parallel group (every rank runs every step; each holds its
        slice of the model and of the KV cache, heads split, and samples the same tokens from the
        gathered logits). On CUDA rank r uses device r (untested)."""
        self.config = config
        self.parallel = parallel
        self.device = torch.device(config.device.device)
        if self.device.type == "cuda" and parallel.device_index is not None:  # chosen by the rank's host
            self.device = torch.device("cuda", parallel.device_index)
        elif self.device.type == "cuda" and (parallel.world_size > 1 or config.parallel.data_parallel_rank):
            self.device = torch.device("cuda", config.parallel.data_parallel_rank * parallel.world_size + parallel.rank)
        self.dtype = torch_dtype(config.model.dtype)
        self.block_size = config.cache.block_size
        # this rank's heads and widths, and its pipeline stage's layers
        self.arch = stage_arch_config(rank_arch_config(config.model.arch, parallel.tp_size), parallel.pp_rank,
                                      parallel.pp_size)
        self.stage: PipelineStage | None = None  # with --pipeline-parallel-size > 1 (load_model)
        self.backend = make_attention_backend(config.runner.attention_backend)
        self.model = None
        self.lora = None  # RunnerLoRA with --enable-lora (after load_model)
        self.kv_caches: list[torch.Tensor] = []
        self.cpu_kv_caches: list[torch.Tensor] = []
        self.states: dict[str, CachedRequestState] = {}
        self._failed_alone: set[str] = set()  # failed in a step, not yet in finished_req_ids
        self.sampler = Sampler(self.arch.vocab_size, self.device, seed=config.model.seed)
        self.structured = StructuredOutputs(config, max_num_rows=config.scheduler.max_num_seqs)
        self.step_sampler = StepSampler(self.sampler, self.structured, make_typical_acceptance(config.speculative))
        self.proposer = None  # speculative decoding's draft proposer (load_model)
        self.graph_runner: CudaGraphRunner | None = None
        self.compiled_decode: CompiledDecode | None = None
        self.cpu_step: CpuDecodeStep | None = None  # CPU: the decode layers in one C call (capture_graphs)
        self.force_static_decode = force_static_decode
        self.static_sizes = capture_sizes(config.scheduler.max_num_seqs)
        self.max_blocks_per_seq = math.ceil(config.model.max_model_len / self.block_size)
        self.sleep_state = RunnerSleep()
        self.kv_scale_calc = KVScaleCalculation(config.cache.calculate_kv_scales)  # --calculate-kv-scales
        torch.manual_seed(config.model.seed)

    # -- start-up ----------------------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        self.model = load_model(self.config, self.backend, self.device, self.parallel)
        if self.parallel.pp_size > 1:
            self.stage = PipelineStage(self.model, self.parallel, self.arch.hidden_size, self.dtype, self.device)
        if self.config.cache.cpu_offload_bytes:  # --cpu-offload-gb (CUDA; refused elsewhere at start-up)
            offload_weights(self.model, self.arch.num_hidden_layers, self.config.cache.cpu_offload_bytes, self.device)
        self.kv_scale_calc.restore(self.model)  # reloaded (sleep level 2): the scales computed before
        if self.config.lora.enable_lora:
            from aserve.runner.lora_step import RunnerLoRA

            self.lora = RunnerLoRA(self.model, self.config.lora, self.device)
        self.proposer = make_proposer(self.config, self.backend, self.device)
        logger.info("Loaded %s (%s, %s) in %.1fs", self.arch.architecture, self.config.model.dtype,
                    self.device, time.perf_counter() - start)

    def _kv_dtype(self) -> torch.dtype:
        return kv_cache_dtype_for(self.config)

    def kv_bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self._kv_dtype()).element_size()
        draft = self.proposer.kv_bytes_per_block() if self.proposer is not None else 0
        return a.num_hidden_layers * 2 * self.block_size * a.num_key_value_heads * a.head_dim * elem + draft

    def initialize_kv_cache(self) -> RunnerInfo:
        per_block = self.kv_bytes_per_block()
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        elif cache.kv_cache_memory_bytes is not None:  # --kv-cache-memory-bytes: no profiling, no fraction
            num_blocks = cache.kv_cache_memory_bytes // per_block
        elif self.device.type == "cuda":
            num_blocks = profile_num_blocks(lambda: run_profile_step(self), self.device, cache.gpu_memory_utilization,
                                            per_block)
        else:
            num_blocks = int(cache.cpu_kvcache_space_gb * GiB // per_block)
        num_blocks = max(num_blocks, 2)  # block 0 is the reserved null block
        num_cpu_blocks = 0
        if self.config.scheduler.preemption_mode == "swap":
            num_cpu_blocks = int(cache.swap_space_gb * GiB // per_block)
        # Tensor-parallel ranks hold the same blocks (their slices of every head): the scheduler sees one pool.
        num_blocks = all_reduce_min(num_blocks, self.parallel)
        num_cpu_blocks = all_reduce_min(num_cpu_blocks, self.parallel)
        self.allocate_kv_caches(num_blocks, num_cpu_blocks)
        self.bind_kv_caches(num_blocks, num_cpu_blocks)
        self.sleep_state.kv_blocks = (num_blocks, num_cpu_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)%s", num_blocks - 1,
                    self.block_size, (num_blocks - 1) * self.block_size, num_blocks * per_block / GiB,
                    self._kv_dtype(),
                    f"; {num_cpu_blocks} CPU swap blocks" if num_cpu_blocks else "")
        return RunnerInfo(num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_size=self.block_size,
                          kv_bytes_per_block=per_block, device=self.device.type,
                          attention_backend=self.backend.name)

    def allocate_kv_caches(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the target's cache tensors (zero pages on CPU) and its CPU swap tensors."""
        a = self.arch
        shape = (2, num_blocks, self.block_size, a.num_key_value_heads, a.head_dim)
        dtype = self._kv_dtype()
        self.kv_caches = [zeroed(shape, dtype, self.device) for _ in range(a.num_hidden_layers)]
        if num_cpu_blocks:
            cpu_shape = (2, num_cpu_blocks) + shape[2:]
            pin = self.device.type == "cuda"
            self.cpu_kv_caches = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin)
                                  for _ in range(a.num_hidden_layers)]

    def bind_kv_caches(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Binds the allocated cache to the model's attention layers; allocates a draft model's."""
        self.model.bind_kv_caches(self.kv_caches)
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks, num_cpu_blocks)

    # -- sleep mode (between steps, no request running; aserve/runner/sleep_mode.py) ---------------
    def sleep(self, level: int) -> None:
        """Level 1: release the KV cache; level 2: the weights too. ValueError while requests run."""
        self.sleep_state.sleep(self, level)

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Bring back the parts `tags` names ("weights", "kv_cache"; None: both)."""
        self.sleep_state.wake_up(self, tags)

    def capture_graphs(self) -> None:
        """CUDA graphs for decode, or on CPU with -O3 the compiled decode (`runner/graph_capture.py`)."""
        capture_decode(self)

    # -- per step ----------------------------------------------------------------------------------
    def _add_request(self, new: NewRequestData, sampling: bool = True) -> None:
        """Builds the request's state; raises, leaving no state behind, if its sampling state cannot be
        built. Without `sampling` (a pipeline stage before the last) only what the forward needs."""
        token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        num_prompt = len(new.prompt_token_ids)
        if not sampling:
            self.states[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=token_ids, num_prompt_tokens=num_prompt, params=new.sampling_params,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens, sampling=None)
            return
        guided = None
        if new.sampling_params.guided_decoding is not None:
            guided = self.structured.add(new.req_id, new.sampling_params.guided_decoding, new.output_token_ids,
                                         new.stop_token_ids_for_min_tokens)
        try:
            sampling = self.sampler.states.add(new.sampling_params, token_ids, num_prompt,
                                               new.stop_token_ids_for_min_tokens)
        except Exception:
            self.structured.remove(new.req_id)
            raise
        sampling.grammar = guided
        if self.lora is not None:
            self.lora.add_request(new.req_id, new.lora_request)
        self.states[new.req_id] = CachedRequestState(
            req_id=new.req_id, token_ids=token_ids, num_prompt_tokens=num_prompt, params=new.sampling_params,
            block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens, sampling=sampling)

    def _remove_request(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        self.structured.remove(req_id)
        if self.lora is not None:
            self.lora.remove_request(req_id)
        if state is not None and state.sampling is not None:
            self.sampler.states.remove(state.sampling)

    def forget_requests(self) -> None:
        """Drops every request's state (sleep mode: only finished requests can have any left)."""
        for req_id in list(self.states):
            self._remove_request(req_id)

    def fail(self, messages: dict[str, str], failed: dict[str, str], prompt_logprobs: dict) -> None:
        """Fails these requests alone: reported in `failed`, nothing else of theirs in the output."""
        for req_id, message in messages.items():
            failed[req_id] = message
            prompt_logprobs.pop(req_id, None)
            self._remove_request(req_id)

    # -- adapters (between steps) ------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter into the host cache; LoRAAdapterError names what is wrong."""
        if self.lora is None:
            raise LoRAAdapterError("LoRA is not enabled (--enable-lora)")
        self.lora.add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora is not None and self.lora.remove_adapter(lora_int_id)

    def _update_request(self, cached: CachedRequestData) -> None:
        state = self.states[cached.req_id]
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens
        if cached.new_token_ids:  # pipeline parallel: the step's input tokens (sampled on the last stage)
            start = cached.num_computed_tokens
            state.token_ids[start:start + len(cached.new_token_ids)] = cached.new_token_ids

    def _apply_block_ops(self, so: SchedulerOutput) -> None:
        device_caches, cpu_caches = self.kv_caches, self.cpu_kv_caches
        if self.proposer is not None and self.proposer.kv_caches:  # a draft model's cache moves with the target's
            device_caches, cpu_caches = device_caches + self.proposer.kv_caches, cpu_caches + self.proposer.cpu_kv_caches
        copy_blocks(so.blocks_to_swap_out, device_caches, cpu_caches)
        copy_blocks(so.blocks_to_swap_in, cpu_caches, device_caches)

    def prepare(self, req_ids: list[str], num_tokens: list[int], spec: dict[str, list[int]]) -> ModelInputs:
        static = self.graph_runner is not None or self.force_static_decode
        pad_to = None
        if static and all(n == 1 or r in spec for r, n in zip(req_ids, num_tokens)):  # decode rows only
            pad_to = padded_size(self.static_sizes, sum(num_tokens))
        return build_model_inputs(self.states, req_ids, num_tokens, self.block_size, self.device,
                                  pad_to_num_seqs=pad_to, spec_token_ids=spec)

    def _forward(self, inputs: ModelInputs, context: ForwardContext | None = None) -> torch.Tensor:
        """`context`: the step's forward context (LoRA slots). CUDA graphs read the LoRA slots from the
        static buffer they were captured with; the CPU compiled decode holds no LoRA work, so steps
        with LoRA tokens run eagerly there."""
        if self.kv_scale_calc.pending:
            return self.kv_scale_calc.first_step(self.model, lambda: self._forward(inputs, context),
                                                 self.capture_graphs, inputs.meta.num_tokens)
        meta = inputs.meta
        lora = context.lora if context is not None else None
        if (lora is None and self.compiled_decode is not None
                and self.compiled_decode.can_run(meta, inputs.input_ids.shape[0])):
            return self.compiled_decode.run(inputs.input_ids, inputs.positions, meta)
        if lora is None and self.cpu_step is not None and self.cpu_step.can_run(meta, inputs.input_ids.shape[0]):
            return self.cpu_step.run(inputs.input_ids, inputs.positions, meta)
        g = self.graph_runner
        if (g is not None and meta.num_decodes == meta.num_seqs and meta.num_seqs in g.graphs
                and g.can_run(meta.num_seqs, meta.max_seq_len, meta.block_tables.shape[1])):
            if self.lora is not None:
                self.lora.manager.fill_static_token_slots(lora)
            return g.run(inputs.input_ids, inputs.positions, meta)
        if context is None:
            return self.model(inputs.input_ids, inputs.positions, meta)
        with set_forward_context(context):
            return self.model(inputs.input_ids, inputs.positions, meta)

    def _run_stage(self, inputs: ModelInputs) -> RunnerOutput:
        """A pipeline stage before the last: its layers, then the stream to the next stage; nothing sampled."""
        hidden, _ = self.timed_forward(inputs)
        self.stage.send(hidden)
        for req_id, num in zip(inputs.req_ids, inputs.num_scheduled):
            self.states[req_id].num_computed_tokens += num
        return RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])

    def timed_forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, float]:
        """The step's forward pass (with its LoRA context) and its seconds: measured only with detailed
        traces (--collect-detailed-traces model|all; on CUDA the kernels' time, not the launches'), else 0."""
        timed = self.config.observability.collect_model_forward_time
        if self.stage is not None:  # the previous stage's stream (before the clock starts: not this stage's work)
            self.stage.receive(inputs.input_ids.shape[0])
        start = time.perf_counter() if timed else 0.0
        hidden = self._forward(inputs, self.lora.forward_context(inputs) if self.lora is not None else None)
        if timed and hidden.is_cuda:
            torch.cuda.synchronize(hidden.device)
        return hidden, (time.perf_counter() - start if timed else 0.0)

    def sample(self, hidden: torch.Tensor, inputs: ModelInputs, spec: dict[str, list[int]], fill) -> StepSamples:
        """Samples (or verifies `spec`'s drafts of) the step's sampling requests from their rows of
        `hidden`; the tokens are appended to each request's state (StepSampler.sample)."""
        wanted = inputs.logits_indices
        if len(wanted) == hidden.shape[0] and wanted[-1] == len(wanted) - 1:  # (increasing: every row, in order)
            rows = hidden
        else:
            rows = hidden.index_select(0, torch.tensor(wanted, dtype=torch.int64, device=hidden.device))
        if not spec and fill is None and self.step_sampler.plain_greedy(inputs.sample_req_ids, self.states):
            greedy = getattr(self.model, "greedy_tokens", None)  # (pooling models have none)
            tokens = greedy(rows) if greedy is not None else None
            if tokens is not None:
                return self.step_sampler.take_greedy(tokens, inputs.sample_req_ids, self.states)
        logits = self.model.compute_logits(rows)
        return self.step_sampler.sample(logits, inputs.sample_req_ids, self.states, spec, fill)

    def execute(self, so: SchedulerOutput, on_progress: Callable[[RunnerOutput], None] | None = None
                ) -> RunnerOutput:
        """Runs one step (with `so.decode_steps`, a multi-step call: `runner/multi_step.py`; `on_progress`
        then receives each decode step's output but the last, which is returned). Requests that fail
        alone (see the module docstring) are in `failed_requests` and nowhere else in the output, and
        their state is gone (a step scheduled before the failure came back skips them); any exception
        raised is fatal."""
        self._failed_alone.difference_update(so.finished_req_ids)
        out = self._execute(so, on_progress)
        self._failed_alone.update(out.failed_requests)
        return out

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput, on_progress: Callable[[RunnerOutput], None] | None) -> RunnerOutput:
        for req_id in so.finished_req_ids:
            self._remove_request(req_id)
        self._apply_block_ops(so)
        failed: dict[str, str] = {}
        samples_here = self.stage is None or self.stage.is_last
        for new in so.new_requests:
            try:
                self._add_request(new, sampling=samples_here)
            except Exception as e:  # noqa: BLE001 - belongs to this request alone
                failed[new.req_id] = f"could not set up sampling for this request: {type(e).__name__}: {e}"
                if self.stage is not None:  # its rows still run: every stage packs the same token rows
                    self._add_request(new, sampling=False)
        # async scheduling: a request that failed alone in the step before may be in this one too
        gone = {c.req_id for c in so.cached_requests if c.req_id in self._failed_alone}
        for cached in so.cached_requests:
            if cached.req_id not in gone:
                self._update_request(cached)
        if self.lora is not None:  # requests whose adapter cannot be loaded fail alone
            for req_id, message in self.lora.load_missing(so.scheduled_req_ids).items():
                failed[req_id] = message
                self._remove_request(req_id)
        scheduled = [(r, n) for r, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens)
                     if (r not in failed or self.stage is not None) and r not in gone]
        if not scheduled:
            return RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], failed_requests=failed)

        spec = so.scheduled_spec_token_ids
        inputs = self.prepare([r for r, _ in scheduled], [n for _, n in scheduled], spec)
        if self.stage is not None:
            if not self.stage.is_last:
                return self._run_stage(inputs)
            if failed:  # their rows were computed; they neither sample nor score their prompt
                inputs = unsampled(inputs, failed)
        fill = self.structured.start_fill(inputs.sample_req_ids)  # overlaps the forward pass
        hidden, forward_time = self.timed_forward(inputs)
        if self.proposer is not None:
            self.proposer.catch_up(inputs)

        prompt_logprobs = {}
        for req_id, (start, count, first_target) in inputs.prompt_logprob_spans.items():
            state = self.states[req_id]
            logits = self.model.compute_logits(hidden[start:start + count])
            targets = torch.tensor(state.token_ids[first_target:first_target + count], device=self.device)
            prompt_logprobs[req_id] = compute_prompt_logprobs(logits, targets, state.params.prompt_logprobs)

        samples = StepSamples()
        if inputs.sample_req_ids:
            samples = self.sample(hidden, inputs, spec, fill)
            self.fail(samples.failed, failed, prompt_logprobs)

        for req_id, num in zip(inputs.req_ids, inputs.num_scheduled):
            state = self.states.get(req_id)
            if state is not None:
                state.num_computed_tokens += num - samples.num_rejected.get(req_id, 0)
        if self.stage is not None:
            for req_id in failed:
                self._remove_request(req_id)
        if so.decode_steps:
            return run_later_decode_steps(self, so.decode_steps, inputs, samples, failed, forward_time, on_progress)
        drafts = {}
        if so.propose_drafts and self.proposer is not None and samples.req_ids:
            drafts = self.proposer.propose(samples.req_ids, self.states, inputs)
        return RunnerOutput(req_ids=samples.req_ids, sampled_token_ids=samples.token_ids, logprobs=samples.logprobs,
                            prompt_logprobs=prompt_logprobs, failed_requests=failed, draft_token_ids=drafts,
                            forward_time=forward_time)

