"""This rank's pipeline stage (`--pipeline-parallel-size`): the hand-off of the residual stream between
stages around the runner's forward pass.

Every rank of every stage runs the same step (the same `SchedulerOutput`, so the same packed inputs and
the same number of token rows). A stage that is not the first receives the previous stage's stream
before its forward (`receive`): global rank r takes it from rank r - tp_size (the same tensor-parallel
rank one stage earlier, which holds the whole stream after its all-reduce). A stage that is not the
last sends its own after (`send`, asynchronous: the rank goes on to its next step while the tensor
travels, so stages overlap when the engine keeps several steps in flight). Only the last stage
computes logits and samples; the others learn each step's input tokens from the scheduler
(`CachedRequestData.new_token_ids`).

The stream's dtype is whatever the sending stage's last layer left it in (float32 inside a bf16 model
on the CPU kernels, which keep the residual stream unrounded; the model dtype on the native forms), and
the receiver must hand its first layer exactly that. So it travels as float32 (exact for bf16 / fp16)
with one trailing element naming the dtype, as raw bytes on the world group; send and receive pair up
in step order because every rank runs the steps in the order the engine submitted them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from aserve.distributed.context import ParallelContext
from aserve.model.pipeline import make_stage
from aserve.runner.input_batch import ModelInputs

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the trailing element's codes


class PipelineStage:
    """Stage `parallel.pp_rank` of the loaded stage model `model` (turned into the stage here:
    `model/pipeline.py` `make_stage`), whose stream is `[tokens, hidden_size]`; `dtype` the model's."""

    def __init__(self, model: nn.Module, parallel: ParallelContext, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.parallel = parallel
        self.is_first, self.is_last = parallel.is_first_stage, parallel.is_last_stage
        self.input = make_stage(model, self.is_first, self.is_last)
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._sends: deque = deque()  # (work, tensor): sends in flight, oldest first

    def receive(self, num_tokens: int) -> None:
        """Before the forward of a step with `num_tokens` rows: the previous stage's stream (blocking)."""
        if self.input is None:
            return
        if not num_tokens:
            self.input.set_stream(torch.empty((0, self.hidden_size), dtype=torch.float32, device=self.device))
            return
        size = num_tokens * self.hidden_size
        data = torch.empty(size + 1, dtype=torch.float32, device=self.device)
        dist.recv(data.view(torch.uint8), src=self.parallel.rank - self.parallel.tp_size,
                  group=self.parallel.world_group)
        dtype = _DTYPES[int(data[size].item())]
        self.input.set_stream(data[:size].view(num_tokens, self.hidden_size).to(dtype))

    def feed_dummy(self, num_tokens: int) -> None:
        """A profile pass with no previous stage behind it: zeros (in the model's dtype) as the stream."""
        if self.input is not None:
            self.input.set_stream(torch.zeros((num_tokens, self.hidden_size), dtype=self.dtype, device=self.device))

    def send(self, stream: torch.Tensor) -> None:
        """After the forward of a non-last stage: `stream` to the next stage, without waiting for it to
        arrive (at most `pp_size` sends stay in flight; the oldest is waited for beyond that)."""
        if not stream.shape[0]:
            return
        code = torch.tensor([float(_DTYPES.index(stream.dtype))], dtype=torch.float32, device=stream.device)
        data = torch.cat((stream.reshape(-1).to(torch.float32), code)).view(torch.uint8)
        work = dist.isend(data, dst=self.parallel.rank + self.parallel.tp_size, group=self.parallel.world_group)
        self._sends.append((work, data))
        while len(self._sends) > self.parallel.pp_size:
            self._sends.popleft()[0].wait()

    def flush(self) -> None:
        """Waits for every send in flight (before leaving the process group)."""
        while self._sends:
            self._sends.popleft()[0].wait()


def unsampled(inputs: ModelInputs, req_ids: Iterable[str]) -> ModelInputs:
    """`inputs` with `req_ids` neither sampling nor scoring their prompt (their rows still run: the last
    stage receives every row the earlier stages computed). Each sampling request has one logits row
    (no drafts with pipeline parallelism)."""
    drop = set(req_ids)
    kept = [(r, i) for r, i in zip(inputs.sample_req_ids, inputs.logits_indices, strict=True) if r not in drop]
    return dataclasses.replace(inputs, sample_req_ids=[r for r, _ in kept], logits_indices=[i for _, i in kept],
                               prompt_logprob_spans={r: span for r, span in inputs.prompt_logprob_spans.items()
                                                     if r not in drop})
