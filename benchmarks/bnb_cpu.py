"""bitsandbytes 4-bit (NF4, blocks of 64) products on this CPU: bnb's own paths vs aserve's dequantize-per-call.

    python benchmarks/bnb_cpu.py --rows 1,16

For SmolLM2-135M's Linear shapes `[N, K]` (576x576, 1536x576, 576x1536) and fp32 / bf16 activations:
milliseconds per product (median of 20) of
  bnb Linear4bit   `bitsandbytes.nn.Linear4bit.forward` (eval mode: whatever bnb runs on CPU)
  bnb matmul_4bit  `bitsandbytes.matmul_4bit(x, W.t(), quant_state=...)`
  bnb deq+linear   `bitsandbytes.functional.dequantize_4bit` then `F.linear`
  aserve           a `Linear` with `--quantization bitsandbytes`'s method (aserve/model/quantization/bitsandbytes.py)
  float            `F.linear` on the float weight (the reference cost)
Not part of CI; the README's quantization section quotes it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from cpu_gemm import median_seconds

SHAPES = [(576, 576), (1536, 576), (576, 1536)]


def _median_ms(fn, repeats: int = 20) -> float:
    with torch.no_grad():
        return 1e3 * median_seconds(fn, repeats)


def main() -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    from aserve.model.layers.linear import Linear
    from aserve.model.quantization.bitsandbytes import BnbInFlightMethod

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16", help="comma-separated row counts (M)")
    args = parser.parse_args()
    print(f"bitsandbytes {bnb.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("dtype  rows  shape       bnb-Linear4bit  bnb-matmul_4bit  bnb-deq+linear  aserve  float   (ms)")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (int(r) for r in args.rows.split(",")):
            for n, k in SHAPES:
                w = torch.randn(n, k) * 0.02
                packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
                lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, quant_type="nf4")
                lin.weight = bnb.nn.Params4bit(w.to(dtype), requires_grad=False, quant_type="nf4")
                lin = lin.to("cpu").eval()  # quantizes on .to()? bnb quantizes on device moves / first use
                x = torch.randn(rows, k).to(dtype)
                ours = Linear(k, n, dtype=dtype)
                ours.set_quant_method(BnbInFlightMethod())
                ours.weight.data.copy_(w)
                ours.process_weights_after_loading()
                wf = w.to(dtype)
                cells = []
                for fn in (lambda lin=lin, x=x: lin(x),
                           lambda x=x, p=packed, s=state: bnb.matmul_4bit(x, p.t(), quant_state=s),
                           lambda x=x, p=packed, s=state, d=dtype: F.linear(x, bnbf.dequantize_4bit(p, s).to(d)),
                           lambda ours=ours, x=x: ours(x),
                           lambda x=x, wf=wf: F.linear(x, wf)):
                    try:
                        cells.append(f"{_median_ms(fn):.3f}")
                    except Exception as exc:  # noqa: BLE001 (a path bnb does not run here is reported)
                        cells.append(f"error: {type(exc).__name__}: {str(exc)[:60]}")
                print(f"{str(dtype)[6:]:8} {rows:3}  {n}x{k}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
