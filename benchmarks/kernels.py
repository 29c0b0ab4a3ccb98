"""Benchmark each Triton kernel against its torch reference (and torch SDPA for attention).

    python benchmarks/kernels.py                 # CUDA: time every kernel over its shape sweep
    python benchmarks/kernels.py --only decode   # one kernel family
    python benchmarks/kernels.py --smoke         # CPU through the Triton interpreter: tiny shapes, errors only

On CUDA it reports the median time of each call replayed in a CUDA graph (triton.testing.do_bench_cudagraph:
what the served model's decode graphs pay, without the Python wrapper's and Triton's launch cost, which
the first H200 run showed dominating the split-context decode timings; `--eager` times plain calls with
do_bench instead; a call that cannot be captured falls back to do_bench, marked `*`), the achieved bandwidth (the bytes
each op must move at least, over its time) and the max error against the reference. Without
CUDA it says that timing needs a GPU and exits 0; `--smoke` instead runs every case once at
tiny shapes through the interpreter to check the harness and the kernels agree with the reference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from aserve.kernels import reference
from aserve.kernels.activation import silu_and_mul
from aserve.kernels.paged_decode_attention import paged_decode_attention
from aserve.kernels.paged_prefill_attention import paged_prefill_attention
from aserve.kernels.reshape_and_cache import reshape_and_cache
from aserve.kernels.rms_norm import rms_norm
from aserve.kernels.rotary import rotary_embedding
from triton.testing import do_bench, do_bench_cudagraph


@dataclass
class Case:
    """One shape of one kernel: the contenders (name -> thunk), the bytes moved, and an error check."""

    kernel: str
    shape: str
    contenders: dict[str, Callable[[], object]]
    num_bytes: int
    max_error: Callable[[], float]


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen):
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    # generated on the device: the long-context caches are gigabytes
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    return cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _contiguous_kv(cache, table, seq_len):
    """The same K/V as dense [B, KVH, L, D] tensors (equal lengths): SDPA's best case, no paging."""
    k = cache[0][table.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2)
    v = cache[1][table.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2)
    return k.contiguous(), v.contiguous()


def _err(kernel: Callable[[], torch.Tensor], ref: Callable[[], torch.Tensor]) -> float:
    return (kernel().float() - ref().float()).abs().max().item()


def decode_cases(device, dtype, smoke, gen) -> Iterator[Case]:
    shapes = [(2, 4, 2, 64, 16, 40)] if smoke else [
        (1, 32, 8, 128, 16, 4096), (8, 32, 8, 128, 16, 2048), (32, 32, 8, 128, 16, 1024),
        (64, 32, 8, 128, 16, 512), (128, 32, 8, 128, 16, 1024), (8, 32, 32, 128, 16, 2048),
        (16, 32, 8, 128, 16, 16384), (32, 16, 2, 64, 16, 1024), (32, 32, 8, 256, 16, 1024),
        (32, 32, 8, 128, 64, 1024),
    ]  # fmt: skip
    for batch, heads, kv_heads, head_dim, block_size, ctx in shapes:
        cache, table, lens = _paged_kv([ctx] * batch, block_size, kv_heads, head_dim, dtype, device, gen)
        q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype).to(device)
        args = (q, cache, table, lens, head_dim**-0.5)
        k, v = _contiguous_kv(cache, table, ctx)
        triton_fn = partial(paged_decode_attention, *args)
        ref_fn = partial(reference.paged_decode_attention, *args)
        contenders = {
            "triton": triton_fn,
            "triton-nosplit": partial(paged_decode_attention, *args, num_splits=1),
            "torch-ref": ref_fn,
            "sdpa-dense": partial(
                F.scaled_dot_product_attention, q.unsqueeze(2), k, v, scale=head_dim**-0.5,
                enable_gqa=heads != kv_heads,
            ),
        }  # fmt: skip
        shape = f"B={batch} H={heads} KVH={kv_heads} D={head_dim} bs={block_size} ctx={ctx}"
        yield Case("decode", shape, contenders, _nbytes(q, q, k, v), partial(_err, triton_fn, ref_fn))


def prefill_cases(device, dtype, smoke, gen) -> Iterator[Case]:
    shapes = [(2, 4, 2, 64, 16, 20, 8)] if smoke else [
        (1, 32, 8, 128, 16, 2048, 0), (4, 32, 8, 128, 16, 1024, 0), (8, 32, 8, 128, 16, 512, 1536),
        (1, 32, 8, 128, 16, 8192, 0), (2, 32, 8, 256, 16, 1024, 0), (16, 16, 2, 64, 16, 256, 0),
    ]  # fmt: skip
    for num_seqs, heads, kv_heads, head_dim, block_size, q_len, cached in shapes:
        seq_len = q_len + cached
        cache, table, lens = _paged_kv(
            [seq_len] * num_seqs, block_size, kv_heads, head_dim, dtype, device, gen
        )
        q = torch.randn(num_seqs * q_len, heads, head_dim, generator=gen).to(dtype).to(device)
        starts = [i * q_len for i in range(num_seqs + 1)]
        qsl = torch.tensor(starts, dtype=torch.int32, device=device)
        args = (q, cache, table, qsl, lens, head_dim**-0.5)
        k, v = _contiguous_kv(cache, table, seq_len)
        dense_q = q.view(num_seqs, q_len, heads, head_dim).transpose(1, 2)
        mask = reference.causal_mask(q_len, seq_len, None, device)
        triton_fn = partial(paged_prefill_attention, *args, query_start_loc_cpu=starts)
        ref_fn = partial(reference.paged_prefill_attention, *args, query_start_loc_cpu=starts)
        contenders = {
            "triton": triton_fn,
            "torch-ref": ref_fn,
            "sdpa-dense": partial(
                F.scaled_dot_product_attention, dense_q, k, v, attn_mask=mask, scale=head_dim**-0.5,
                enable_gqa=heads != kv_heads,
            ),
        }  # fmt: skip
        shape = f"S={num_seqs} H={heads} KVH={kv_heads} D={head_dim} q={q_len} cached={cached}"
        yield Case("prefill", shape, contenders, _nbytes(q, q, k, v), partial(_err, triton_fn, ref_fn))


def _cache_error(key, value, cache, ref_cache, slots, scale) -> float:
    reshape_and_cache(key, value, cache, slots, scale, scale)
    reference.reshape_and_cache(key, value, ref_cache, slots, scale, scale)
    return (cache.float() - ref_cache.float()).abs().max().item()


def cache_cases(device, dtype, smoke, gen) -> Iterator[Case]:
    shapes = [(5, 2, 64, torch.float16)] if smoke else [
        (256, 8, 128, dtype), (4096, 8, 128, dtype), (4096, 8, 128, torch.float8_e4m3fn), (16384, 2, 64, dtype),
    ]  # fmt: skip
    for tokens, kv_heads, head_dim, cache_dtype in shapes:
        block_size = 16
        num_blocks = -(-tokens // block_size) + 1
        key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        value = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device=device).to(cache_dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
        scale = 0.5 if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 1.0
        ref_cache = cache.clone()
        contenders = {
            "triton": partial(reshape_and_cache, key, value, cache, slots, scale, scale),
            "torch-ref": partial(reference.reshape_and_cache, key, value, ref_cache, slots, scale, scale),
        }
        moved = _nbytes(key, value) + _nbytes(key, value) * cache.element_size() // key.element_size()
        shape = f"T={tokens} KVH={kv_heads} D={head_dim} cache={str(cache_dtype).removeprefix('torch.')}"
        error = partial(_cache_error, key, value, cache, ref_cache, slots, scale)
        yield Case("reshape_and_cache", shape, contenders, moved, error)


def _pair_error(kernel, ref, *args) -> float:
    """Max error of the first output (rms_norm and rotary return tuples)."""
    got, want = kernel(*args), ref(*args)
    if isinstance(got, tuple):
        got, want = got[0], want[0]
    return (got.float() - want.float()).abs().max().item()


def elementwise_cases(device, dtype, smoke, gen) -> Iterator[Case]:
    rows = [4] if smoke else [1, 256, 4096]
    hidden, inter, heads, kv_heads, head_dim = (64, 96, 2, 1, 64) if smoke else (4096, 14336, 32, 8, 128)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(4096).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(device)
    for t in rows:
        x, res = (torch.randn(t, hidden, generator=gen).to(dtype).to(device) for _ in range(2))
        w = torch.randn(hidden, generator=gen).to(dtype).to(device)
        args = (x, w, 1e-6, res)
        yield Case(
            "rms_norm", f"T={t} N={hidden} +residual",
            {"triton": partial(rms_norm, *args), "torch-ref": partial(reference.rms_norm, *args)},
            _nbytes(x, res, x, res, w), partial(_pair_error, rms_norm, reference.rms_norm, *args),
        )  # fmt: skip
        gate_up = torch.randn(t, 2 * inter, generator=gen).to(dtype).to(device)
        yield Case(
            "silu_and_mul", f"T={t} N={inter}",
            {"triton": partial(silu_and_mul, gate_up), "torch-ref": partial(reference.silu_and_mul, gate_up)},
            _nbytes(gate_up) * 3 // 2, partial(_pair_error, silu_and_mul, reference.silu_and_mul, gate_up),
        )  # fmt: skip
        pos = torch.randint(0, 4096, (t,), generator=gen).to(device)
        q = torch.randn(t, heads, head_dim, generator=gen).to(dtype).to(device)
        k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        args = (pos, q, k, cos_sin)
        yield Case(
            "rotary", f"T={t} H={heads} KVH={kv_heads} D={head_dim} neox",
            {"triton": partial(rotary_embedding, *args), "torch-ref": partial(reference.rotary_embedding, *args)},
            2 * _nbytes(q, k) + t * head_dim * 4,
            partial(_pair_error, rotary_embedding, reference.rotary_embedding, *args),
        )  # fmt: skip


FAMILIES = {
    "decode": decode_cases,
    "prefill": prefill_cases,
    "cache": cache_cases,
    "elementwise": elementwise_cases,
}


def _time(fn: Callable[[], object], eager: bool) -> tuple[float, str]:
    """Median milliseconds of `fn`: replayed in a CUDA graph unless `eager` (or when capture fails: then
    plain calls, marked '*')."""
    if not eager:
        try:
            fn()  # compile outside the capture
            torch.cuda.synchronize()
            return do_bench_cudagraph(fn, rep=50, return_mode="median"), ""
        except RuntimeError:
            torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median"), ("" if eager else "*")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=sorted(FAMILIES), action="append", help="kernel families to run")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, errors only")
    parser.add_argument("--eager", action="store_true", help="time plain calls (do_bench) instead of CUDA graph replays")
    args = parser.parse_args(argv)

    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/kernels.py: timing needs a CUDA device; none found, nothing to do "
              "(use --smoke to check the kernels on CPU through the Triton interpreter).")  # fmt: skip
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    # the interpreter's tl.dot is wrong on bf16 operands, so --smoke uses fp16
    dtype = torch.float16 if args.smoke else getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if not args.smoke:
        print(f"# {torch.cuda.get_device_name(device)}, {dtype}, times in microseconds (median of " + ("do_bench" if args.eager else "CUDA graph replays") + ")")
    for family in args.only or list(FAMILIES):
        for case in FAMILIES[family](device, dtype, args.smoke, gen):
            error = case.max_error()
            if args.smoke:
                for fn in case.contenders.values():
                    fn()  # the harness's other contenders at least run
                print(f"{case.kernel:18s} {case.shape:50s} max|err|={error:.2e}")
                continue
            cells = []
            for name, fn in case.contenders.items():
                ms, mark = _time(fn, args.eager)
                cells.append(f"{name}{mark} {ms * 1e3:8.1f}us {case.num_bytes / ms / 1e6:7.1f}GB/s")
            print(f"{case.kernel:18s} {case.shape:50s} err={error:.1e} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
