"""aserve's C attention kernels on this CPU (issue 27): decode attention per layer call at a batch and
context length, and prefill attention for one prompt against torch's SDPA over the same keys (what the
torch backend ran before; the gather it also needed is not counted). SmolLM2-135M's heads: 9 query,
3 KV, head size 64; random bf16 cache with shuffled blocks of 16.

    python benchmarks/cpu_attention.py [--decode 16x480,1x480] [--prefill 280,512]

By hand, not CI; numbers go in the README with the CPU and date.
"""

from __future__ import annotations

import argparse
import time

import torch

from aserve.kernels import cpu_ops, reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _cache(num_seqs: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_seq = -(-length // BLOCK)
    num_blocks = num_seqs * per_seq + 4
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    tables = torch.randperm(num_blocks)[:num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
    return cache, tables


def _ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def decode_row(kernels: cpu_ops.CpuKernels, num_seqs: int, length: int) -> str:
    cache, tables = _cache(num_seqs, length)
    lens = torch.full((num_seqs,), length, dtype=torch.int32)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM).bfloat16()
    ms = _ms(lambda: kernels.paged_decode_attention(q, cache, tables, lens, HEAD_DIM**-0.5), 200)
    kv_bytes = num_seqs * length * KV_HEADS * HEAD_DIM * 2 * 2
    return f"| decode | {num_seqs} x {length} | {ms * 1e3:.0f} us | {kv_bytes / ms / 1e6:.1f} GB/s of K/V | |"


def prefill_row(kernels: cpu_ops.CpuKernels, length: int) -> str:
    cache, tables = _cache(1, length)
    q = torch.randn(length, HEADS, HEAD_DIM).bfloat16()
    starts = torch.tensor([0, length], dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)
    out = torch.empty_like(q)
    blocks = tables[0].long()
    keys, values = (cache[i][blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:length] for i in (0, 1))
    c_ms = _ms(lambda: kernels.paged_prefill_attention(q, cache, tables, lens, starts, (0, 1), out,
                                                        HEAD_DIM**-0.5), 20)
    sdpa_ms = _ms(lambda: reference.attend_prefill(q, keys, values, None, HEAD_DIM**-0.5), 20)
    return f"| prefill | {length} tokens | {c_ms:.2f} ms | SDPA {sdpa_ms:.2f} ms | {sdpa_ms / c_ms:.1f}x |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", default="1x480,16x300,16x480", help="BATCHxCONTEXT list: %(default)s")
    p.add_argument("--prefill", default="280,512,2048", help="prompt lengths: %(default)s")
    args = p.parse_args()
    kernels = cpu_ops.load()
    if kernels is None:
        raise SystemExit("aserve's C kernels are not available here (no C compiler?)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one layer's call")
    print("| kernel | shape | aserve C | compared | speed-up |\n|---|---|---:|---:|---:|")
    for item in filter(None, args.decode.split(",")):
        batch, length = (int(v) for v in item.split("x"))
        print(decode_row(kernels, batch, length))
    if not kernels.native_bf16_dot:  # the C prefill attention needs AVX512-BF16; torch's SDPA runs elsewhere
        print("(prefill: no C kernel on this CPU, which lacks the bf16 dot product)")
        return
    for item in filter(None, args.prefill.split(",")):
        print(prefill_row(kernels, int(item)))


if __name__ == "__main__":
    main()
