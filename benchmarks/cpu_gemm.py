"""bf16 matrix products on this CPU: aserve's packed C kernel vs oneDNN's packed weights vs `F.linear`.

    python benchmarks/cpu_gemm.py --rows 1,16,64,1024

For each row count, SmolLM2-135M's four Linear shapes (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536): milliseconds for one product of each (median of 5) and the achieved GFLOP/s. The four
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
from aserve.model.quantization.cpu_packed import pack_weight, packed_linear

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
    if kernels is None or not kernels.native_bf16_dot:
        raise SystemExit("aserve's packed kernel needs a C compiler and AVX512-BF16 on this CPU")
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16) for n, k in SHAPES]
    vnni, onednn = [kernels.pack_vnni(w) for w in weights], [pack_weight(w) for w in weights]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("| rows | aserve packed | oneDNN packed | F.linear |\n|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES}
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        paths = [
            lambda: [kernels.linear_vnni(xs[w.shape[1]], v) for w, v in zip(weights, vnni, strict=True)],
            lambda: [packed_linear(xs[w.shape[1]], p, None) for w, p in zip(weights, onednn, strict=True)],
            lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
        ]
        cells = []
        for fn in paths:
            seconds = median_seconds(fn)
            cells.append(f"{seconds * 1e3:.2f} ms ({flops / seconds / 1e9:.0f} GFLOP/s)")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
