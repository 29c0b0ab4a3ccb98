"""The runner of a pooling model (embed, classify, score, encode): the same step protocol as
`ModelRunner`, but a request whose prompt is fully computed is pooled, not sampled
(`RunnerOutput.pooled_outputs`), and nothing is ever decoded.

Two model kinds (aserve/model/pooling/loading.py):
- encoders (BERT): bidirectional attention over whole prompts packed in one step, no KV cache (the
  scheduler's block accounting is kept, but no cache tensors exist); the engine config guarantees
  each prompt arrives whole (no chunked prefill, no prefix-cache hits);
- decoder embedders (a causal family without its LM head): the paged KV cache and forward of the
  causal model, so chunked prefill and prefix caching apply under LAST pooling; other pooling types
  get whole prompts, as for encoders.

Per request, `PoolingParams` may override the served pooler's `dimensions`, `normalize` and (for a
classifier) `activation`; intake has checked them against the model.
"""

from __future__ import annotations

import itertools
import logging
import math
import time

import numpy as np
import torch

from aserve.config import AserveConfig
from aserve.config.pooler import PoolingType
from aserve.core.batch import PooledData, RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.distributed.context import SINGLE, ParallelContext
from aserve.model.attention.bidirectional import EncoderMetadata
from aserve.model.pooling.loading import load_pooling_model
from aserve.model.pooling.pooler import RequestPooling, pool_requests
from aserve.pooling_params import PoolingParams
from aserve.runner.input_batch import CachedRequestState, build_model_inputs
from aserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class PoolingModelRunner(ModelRunner):
    def __init__(self, config: AserveConfig, force_static_decode: bool = False, parallel: ParallelContext = SINGLE):
        super().__init__(config, force_static_decode, parallel)
        assert config.pooling is not None, "a pooling runner needs a pooling config"
        self.pooling = config.pooling
        self.is_encoder = self.arch.is_encoder
        self.params: dict[str, PoolingParams] = {}

    # -- start-up ----------------------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        self.model = load_pooling_model(
            self.config.model.model_path, self.dtype, self.device, None if self.is_encoder else self.backend,
            self.config.load.load_format, self.config.model.seed, self.arch)
        logger.info("Loaded %s for %s (%s, %s) in %.1fs", self.arch.architecture, self.pooling.task,
                    self.config.model.dtype, self.device, time.perf_counter() - start)

    def initialize_kv_cache(self) -> RunnerInfo:
        """Encoders keep no cache: the scheduler gets enough accounting blocks for `max_num_seqs`
        prompts of `max_model_len` tokens, and no tensor is allocated."""
        if not self.is_encoder:
            return super().initialize_kv_cache()
        per_seq = math.ceil(self.config.model.max_model_len / self.block_size)
        return RunnerInfo(num_blocks=self.config.scheduler.max_num_seqs * per_seq + 1, num_cpu_blocks=0,
                          block_size=self.block_size, kv_bytes_per_block=0, device=self.device.type,
                          attention_backend="encoder")

    def capture_graphs(self) -> None:
        """Nothing to capture: pooling runs prompts only (no decode steps)."""

    def forget_requests(self) -> None:
        self.states.clear()
        self.params.clear()

    # -- per step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
            self.params.pop(req_id, None)
        for new in so.new_requests:
            self.states[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids), num_prompt_tokens=len(new.prompt_token_ids),
                params=new.sampling_params, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, sampling=None)
            self.params[new.req_id] = new.pooling_params or PoolingParams()
        for cached in so.cached_requests:
            self._update_request(cached)
        if not so.scheduled_req_ids:
            return RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        if self.is_encoder:
            done, hidden, starts = self._encode(so.scheduled_req_ids, so.num_scheduled_tokens)
        else:
            done, hidden, starts = self._decode_prompts(so.scheduled_req_ids, so.num_scheduled_tokens)
        for req_id, num in zip(so.scheduled_req_ids, so.num_scheduled_tokens):
            self.states[req_id].num_computed_tokens += num
        pooled = {}
        if done:
            classify = self.model.classify if self.pooling.is_classifier else None
            overrides = [RequestPooling(p.dimensions, p.normalize, p.activation)
                         for p in (self.params[r] for r in done)]
            vectors = pool_requests(hidden, starts, self.pooling.pooler, overrides, classify)
            for req_id, vec in zip(done, vectors):
                array = vec.detach().to("cpu", torch.float32).contiguous().numpy()
                pooled[req_id] = PooledData(data=array.tobytes(), shape=list(array.shape))
        return RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], pooled_outputs=pooled)

    def _encode(self, req_ids: list[str], num_tokens: list[int]) -> tuple[list[str], torch.Tensor, list[int]]:
        """Whole prompts through the encoder: every request is done this step."""
        states = [self.states[r] for r in req_ids]
        meta = EncoderMetadata.from_seq_lens(list(num_tokens), self.device)
        input_ids = torch.from_numpy(np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in states]))
        token_types = None
        if any(self.params[r].token_type_ids for r in req_ids):
            token_types = torch.tensor([t for r, s in zip(req_ids, states)
                                        for t in (self.params[r].token_type_ids or [0] * len(s.token_ids))],
                                       dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids.to(self.device), None, meta, token_types)
        return list(req_ids), hidden, list(itertools.accumulate(num_tokens, initial=0))  # no device sync

    def _decode_prompts(self, req_ids: list[str], num_tokens: list[int]) -> tuple[list[str], torch.Tensor, list[int]]:
        """A causal embedder's step over the paged cache: the requests whose prompt is complete after
        it, with the rows they pool (LAST: the last row of each; else every row, the config having
        made each prompt arrive whole)."""
        inputs = build_model_inputs(self.states, req_ids, num_tokens, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        done = inputs.sample_req_ids  # every token computed after this step
        if not done:
            return [], hidden, [0]
        if self.pooling.pooler.pooling_type == PoolingType.LAST:
            idx = torch.tensor(inputs.logits_indices, dtype=torch.int64, device=hidden.device)
            return done, hidden.index_select(0, idx), list(range(len(done) + 1))
        return inputs.req_ids, hidden, list(inputs.meta.query_start_loc_cpu)
