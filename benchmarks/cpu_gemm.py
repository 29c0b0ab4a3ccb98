"""bf16 matrix products on this CPU: aserve's packed C kernel (bf16 weights, and 4-bit GGUF-style weights)
vs oneDNN's packed weights vs `F.linear`.

    python benchmarks/cpu_gemm.py --rows 1,16,64,1024

For each row count, SmolLM2-135M's four Linear shapes (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536): milliseconds for one product of each (median of 5) and the achieved GFLOP/s (of the
4-bit column too: the same multiply-adds from a quarter of the bytes). oneDNN's column is left out where
oneDNN has no bf16 kernels for the CPU (AVX2-only CPUs). The four
weights (7 MB) stay in cache, so small row counts show per-call cost, not weight streaming (for that,
see the README's step profile). Not part of CI; the README quotes it where it explains the offline
throughput ceiling.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from aserve.kernels import cpu_ops
from aserve.model.quantization.cpu_packed import cpu_packing_supported, pack_weight, packed_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def median_seconds(fn, repeats: int = 5) -> float:
    """The median wall time of `repeats` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,1024", help="comma-separated row counts (M)")
    args = parser.parse_args()
    kernels = cpu_ops.load()
    if kernels is None or not kernels.packed_matmuls:
        raise SystemExit("aserve's packed kernels need a C compiler and AVX512-BF16 or AVX2 on this CPU")
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16) for n, k in SHAPES]
    codes = [torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8) for n, k in SHAPES]
    int4 = [kernels.pack_int4(q, (torch.rand(n, k // 32, generator=gen) * 0.01).half().float(),
                              (torch.randn(n, k // 32, generator=gen) * 0.01).half().float())
            for q, (n, k) in zip(codes, SHAPES, strict=True)]
    vnni = [kernels.pack_vnni(w) for w in weights]
    onednn = [pack_weight(w) for w in weights] if cpu_packing_supported(torch.bfloat16, "cpu") else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, packed products: {kernels.packed_isa}")
    names = ["aserve packed", "aserve 4-bit"] + (["oneDNN packed"] if onednn else []) + ["F.linear"]
    print(f"| rows | {' | '.join(names)} |\n|---:|" + "---:|" * len(names))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES}
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        paths = [
            lambda: [kernels.linear_vnni(xs[w.shape[1]], v) for w, v in zip(weights, vnni, strict=True)],
            lambda: [kernels.linear_int4(xs[w.shape[1]], q) for w, q in zip(weights, int4, strict=True)],
        ] + ([lambda: [packed_linear(xs[w.shape[1]], p, None) for w, p in zip(weights, onednn, strict=True)]]
             if onednn else []) + [lambda: [F.linear(xs[w.shape[1]], w) for w in weights]]
        cells = []
        for fn in paths:
            seconds = median_seconds(fn)
            cells.append(f"{seconds * 1e3:.2f} ms ({flops / seconds / 1e9:.0f} GFLOP/s)")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
