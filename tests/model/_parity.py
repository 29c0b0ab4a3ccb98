"""Test helper: comparing two models' next-token distributions (issue 10's parity metric).

`teacher_forced_parity(reference, candidate, sequences, start)` runs both models over the same token
sequences (teacher forcing: each position sees the true prefix, not the candidate's own choices) and
compares their distributions at every position from `start` on: top-1 agreement and the mean
KL(reference || candidate). `greedy_generate` gives greedy continuations with the paged model, all
sequences batched (one prefill step, then one decode row per sequence per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.model._paged_batch import PagedBatch
from tests.model._tiny_models import run_schedule


@dataclass(frozen=True)
class ParityReport:
    top1_agreement: float  # fraction of positions where both models' argmax agree
    mean_kl: float  # mean KL(reference || candidate) in nats
    num_positions: int

    def __str__(self) -> str:
        return f"top-1 {self.top1_agreement:.2%}, mean KL {self.mean_kl:.4f} over {self.num_positions} positions"


def all_position_logits(model, sequences: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """Float32 logits `[len(seq), vocab]` at every position of every sequence (one prefill each)."""
    num_blocks = sum(-(-len(s) // block_size) for s in sequences) + 1
    steps = [[(i, len(s))] for i, s in enumerate(sequences)]
    return [x.float() for x in run_schedule(model, sequences, steps, block_size, num_blocks)]


def decode_step_logits(model, prompts: list[list[int]], sequences: list[list[int]],
                       block_size: int = 16) -> list[torch.Tensor]:
    """Float32 logits as serving computes them: each prompt prefilled (all in one step), then every
    further token of `sequences` (prompt + forced answer) fed as one decode row per sequence per step,
    all sequences batched. Positions are those of `all_position_logits`."""
    num_blocks = sum(-(-len(s) // block_size) for s in sequences) + 1
    steps = [[(i, len(p)) for i, p in enumerate(prompts)]]
    for t in range(max(len(s) - len(p) for s, p in zip(sequences, prompts, strict=True))):
        steps.append([(i, 1) for i, (s, p) in enumerate(zip(sequences, prompts, strict=True)) if len(p) + t < len(s)])
    return [x.float() for x in run_schedule(model, sequences, steps, block_size, num_blocks)]


def parity(reference_logits: list[torch.Tensor], candidate_logits: list[torch.Tensor], start: int) -> ParityReport:
    """Compare the logits of positions `start:` of each sequence (see the module docstring)."""
    ref = torch.cat([x[start:] for x in reference_logits])
    cand = torch.cat([x[start:] for x in candidate_logits])
    log_p, log_q = ref.log_softmax(-1), cand.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = (ref.argmax(-1) == cand.argmax(-1)).float()
    return ParityReport(float(agree.mean()), float(kl.mean()), ref.shape[0])


def teacher_forced_parity(reference, candidate, sequences: list[list[int]], start: int) -> ParityReport:
    return parity(all_position_logits(reference, sequences), all_position_logits(candidate, sequences), start)


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16) -> list[list[int]]:
    """Greedy continuations (`max_new_tokens` each, no stop tokens) of every prompt, batched."""
    arch = model.arch
    total = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts) + 1
    batch = PagedBatch(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, block_size, total,
                       dtype=model.dtype)
    model.bind_kv_caches(batch.kv_caches)
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        chunks = [(i, list(p)) for i, p in enumerate(prompts)]
        chunks.sort(key=lambda c: len(c[1]) != 1)  # query-length-1 rows first, as the runner packs them
        for _ in range(max_new_tokens):
            input_ids, positions, meta = batch.step(chunks)
            hidden = model(input_ids, positions, meta)
            last = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
            tokens = model.compute_logits(hidden[last]).argmax(-1).tolist()
            for (seq, _), token in zip(chunks, tokens, strict=True):
                out[seq].append(token)
            chunks = [(seq, [token]) for (seq, _), token in zip(chunks, tokens, strict=True)]
    return out
