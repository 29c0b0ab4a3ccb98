"""CPU `-O3`: decode-only steps of chosen batch sizes run an inductor-compiled forward.

What the compiled graph contains: the whole model forward for a decode batch of exactly one of
`RunnerConfig.compile_sizes` (norms, rotary, MLP activations and residual adds fused into generated
C++ kernels; Linear weights called as they are), with each layer's attention as one opaque op
(`aserve::torch_paged_decode`) fed `DecodeInputs`. The graph depends on no value of those inputs and
the context-length dims are marked dynamic, so a growing context never recompiles. Everything else
(prefills, mixed steps, other batch sizes, padding) runs eagerly.

Compiled at start-up (`warm_up`), once per size and per context shape class (one block vs several),
by running dummy decodes against the reserved null block 0 (zeroed again afterwards).
"""

from __future__ import annotations

import logging
import time

import torch

from aserve.model.attention.base import AttentionMetadata, DecodeInputs
from aserve.model.attention.torch_backend import decode_inputs

logger = logging.getLogger(__name__)


class CompiledDecode:
    """`can_run(meta, num_rows)` then `run(input_ids, positions, meta)`; see the module docstring."""

    def __init__(self, model: torch.nn.Module, sizes: tuple[int, ...], kv_caches: list[torch.Tensor],
                 compile_backend: str = "inductor"):
        self.model = model
        self.backend = model.backend  # the torch attention backend: owns the gather scratch
        self.sizes = frozenset(sizes)
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0].shape[2]
        self.sliding_window = model.uniform_sliding_window()  # one decode mask serves every layer
        if any(attn.logit_softcap is not None for attn in model.attention_layers):
            raise ValueError(f"-O3 on CPU: {model.arch.architecture} caps attention scores, which the compiled "
                             "decode does not implement; serve it with -O0 (the default)")
        self._compiled = torch.compile(model, backend=compile_backend, dynamic=False, fullgraph=True)

    def can_run(self, meta: AttentionMetadata, num_rows: int) -> bool:
        """Decodes only, exactly a compiled size, no padding rows and no skipped slots."""
        return (meta.num_decodes == meta.num_seqs == meta.num_tokens == num_rows and num_rows in self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        inputs = decode_inputs(meta, self.kv_caches[0], self.backend, self.sliding_window)
        return self._call(input_ids, positions, inputs)

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: DecodeInputs) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(inputs.block_ids, 0)
        torch._dynamo.maybe_mark_dynamic(inputs.key_buffer, 0)  # grow-only scratch: new sizes over time
        torch._dynamo.maybe_mark_dynamic(inputs.value_buffer, 0)
        if inputs.mask.dim() == 2:
            torch._dynamo.maybe_mark_dynamic(inputs.mask, 1)
        return self._compiled(input_ids, positions, inputs)

    def warm_up(self) -> float:
        """Compile every size (one- and several-block contexts) now; returns the seconds it took."""
        start = time.perf_counter()
        device = self.kv_caches[0].device
        with torch.inference_mode():
            for size in sorted(self.sizes):
                for num_blocks in (1, 2, 3):  # 1 block specializes; 2 and 3 share the dynamic graph
                    block_ids = torch.zeros(size * num_blocks, dtype=torch.int64, device=device)
                    lens = torch.full((size,), num_blocks * self.block_size, dtype=torch.int64, device=device)
                    mask = (torch.ones((size, num_blocks * self.block_size), dtype=torch.bool, device=device)
                            if size > 1 else torch.empty(0, dtype=torch.bool, device=device))
                    slots = torch.arange(size, dtype=torch.int64, device=device) % self.block_size
                    scratch = self.backend.buffer_pair(self.kv_caches[0].dtype, device,
                                                       block_ids.numel() * self.kv_caches[0][0, 0].numel())
                    inputs = DecodeInputs(slots, block_ids, mask, lens[0].clone(), *scratch)
                    ids = torch.zeros(size, dtype=torch.int64, device=device)
                    self._call(ids, lens - 1, inputs)
            for cache in self.kv_caches:
                cache[:, 0].zero_()  # the null block held the dummy tokens' K/V
        return time.perf_counter() - start
