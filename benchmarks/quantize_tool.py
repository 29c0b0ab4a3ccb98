"""`aserve quantize` on the bundled SmolLM2, then the results served (issue 28's benchmark; not part of CI).

    python benchmarks/quantize_tool.py --out-dir /tmp/smol-quantized              # quantize, measure, serve
    python benchmarks/quantize_tool.py --out-dir /tmp/smol-quantized --reuse      # keep existing checkpoints

1. Quantize: `aserve quantize -i HuggingFaceTB/SmolLM2-135M-Instruct -o OUT/<type> --quant-type <type>` for each
   of `--types` (default gptq,awq; the built-in calibration set), timed wall-clock.
2. Quality, in process, one model at a time: resident weight bytes (every parameter and buffer of the loaded
   model, and those of its decoder Linear layers against bf16's) and teacher-forced top-1 against the fp32 model on the 32 chat questions of the built-in set
   (the fp32 model answers each greedily, `--answer-tokens` tokens; each candidate then reads prompt + answer
   with `prompt_logprobs=1`, and its most likely token at every answer position is compared with fp32's).
   Rows: bf16, `--quantization gguf` (the bundled Q4_1 file), and each quantized checkpoint (bf16 activations).
3. Serving: `benchmarks/peers.py`'s passes (a fresh `aserve` per pass, the seeded chat workload of
   `benchmarks/serving.py`) at `--concurrency` (default 1,16) for the same rows.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time

import peers

BUNDLED = "HuggingFaceTB/SmolLM2-135M-Instruct"


def quantize(types: list[str], out_dir: str, reuse: bool) -> dict[str, float | None]:
    """{type: wall seconds (None when reused)}; each checkpoint in out_dir/<type>."""
    seconds: dict[str, float | None] = {}
    for quant_type in types:
        out = os.path.join(out_dir, quant_type)
        if reuse and os.path.isfile(os.path.join(out, "config.json")):
            seconds[quant_type] = None
            continue
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        subprocess.run(["aserve", "quantize", "-i", BUNDLED, "-o", out, "--quant-type", quant_type,
                        "--log-level", "warning"], check=True)
        seconds[quant_type] = time.perf_counter() - started
        print(f"aserve quantize --quant-type {quant_type}: {seconds[quant_type]:.1f} s", file=sys.stderr, flush=True)
    return seconds


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:  # tied weights count once
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def resident_bytes(folder: str, dtype: str, quantization: str | None) -> tuple[int, int]:
    """(every parameter and buffer, those of the decoder Linear layers only) of the loaded model."""
    from aserve.config import EngineArgs
    from aserve.model.attention.torch_backend import TorchAttentionBackend
    from aserve.model.loader import load_model
    from aserve.model.quantization.assign import linear_layers

    config = EngineArgs(model="", dtype=dtype, quantization=quantization).create_config(model_path=folder)
    model = load_model(config, TorchAttentionBackend(), "cpu")
    linear = [t for _, layer in linear_layers(model) for t in [*layer.parameters(), *layer.buffers()]]
    return _tensor_bytes([*model.parameters(), *model.buffers()]), _tensor_bytes(linear)


def top1_at_answers(llm, sequences: list[list[int]], starts: list[int]) -> list[list[int]]:
    """The most likely token at each answer position of each sequence (prompt_logprobs=1)."""
    from aserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    best = []
    for out, start in zip(outs, starts, strict=True):
        rows = out.prompt_logprobs[start:]
        best.append([min(row.items(), key=lambda kv: kv[1].rank)[0] for row in rows])
    return best


def quality_rows(rows: list[tuple[str, str, str, str | None]], answer_tokens: int) -> list[dict]:
    """[(name, model, dtype, quantization)] -> [{name, weights MiB, top-1}] against fp32 (bundled)."""
    import gc

    from aserve import LLM, SamplingParams
    from aserve.model_source import resolve_model
    from aserve.quantize.default_texts import CHAT_QUESTIONS

    folder = resolve_model(BUNDLED)
    kwargs = {"max_model_len": 512, "enforce_eager": True, "disable_log_stats": True}
    ref = LLM(model=BUNDLED, dtype="float32", **kwargs)
    tok = ref.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in CHAT_QUESTIONS]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    answers = ref.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    sequences = [p + list(a.outputs[0].token_ids) for p, a in zip(prompts, answers, strict=True)]
    starts = [len(p) for p in prompts]
    want = top1_at_answers(ref, sequences, starts)
    del ref
    gc.collect()
    out = []
    for name, model, dtype, quantization in rows:
        llm = LLM(model=model, dtype=dtype, quantization=quantization, **kwargs)
        got = top1_at_answers(llm, sequences, starts)
        del llm
        gc.collect()
        agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
        total = sum(len(w) for w in want)
        path = folder if model == BUNDLED else model
        every, linear = resident_bytes(path, dtype, quantization)
        out.append({"name": name, "weights_mib": every / 2**20, "linear_mib": linear / 2**20,
                    "top1": agree / total, "positions": total})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="checkpoints go to OUT/<type>")
    p.add_argument("--types", default="gptq,awq", help="comma-separated quant types: %(default)s")
    p.add_argument("--reuse", action="store_true", help="keep checkpoints already in --out-dir")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--num-prompts", default="8,48")
    args, rest = p.parse_known_args(argv)
    args.types = [t for t in args.types.split(",") if t]
    serve_argv = ["--concurrency", args.concurrency, "--num-prompts", args.num_prompts, "--systems", "aserve-bf16",
                  *rest]
    args.peers = peers.parse_args(serve_argv)  # the serving passes' flags (peers.py's defaults)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    seconds = quantize(args.types, args.out_dir, args.reuse)
    rows = [("bf16", BUNDLED, "bfloat16", None), ("gguf Q4_1", BUNDLED, "bfloat16", "gguf")]
    rows += [(t, os.path.join(args.out_dir, t), "bfloat16", None) for t in args.types]
    quality = quality_rows(rows, args.answer_tokens)
    info = {"date": datetime.date.today().isoformat(), "cpu": peers.cpu_summary(peers._read_cpuinfo()),
            "command": " ".join(["python", *sys.argv])}
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    print("\n| weights | quantize wall s | resident weights MiB | of which Linear layers (vs bf16) | "
          "teacher-forced top-1 vs fp32 |\n|---|---:|---:|---:|---:|")
    bf16_linear = quality[0]["linear_mib"]
    for q in quality:
        wall = seconds.get(q["name"])
        print(f"| {q['name']} | {'-' if wall is None else f'{wall:.0f}'} | {q['weights_mib']:.1f} | "
              f"{q['linear_mib']:.1f} ({q['linear_mib'] / bf16_linear:.0%}) | {q['top1']:.1%} ({q['positions']} positions) |")
    if args.skip_serving:
        return 0
    aserve = shutil.which("aserve") or "aserve"
    extra = ["--dtype", "bfloat16", "--disable-log-requests"]
    systems = [peers.System("bf16", "aserve", "bf16", [aserve, "--model", BUNDLED, *extra]),
               peers.System("gguf", "aserve", "gguf Q4_1", [aserve, "--model", BUNDLED, "--quantization", "gguf",
                                                             *extra])]
    systems += [peers.System(t, "aserve", f"{t} (aserve quantize)",
                             [aserve, "--model", os.path.join(args.out_dir, t), *extra]) for t in args.types]
    log_dir = tempfile.mkdtemp(prefix="aserve-quantize-bench-")
    serve_rows = peers.run_systems(systems, args.peers, log_dir, peers.run_pass, lambda s: {})
    return peers.report({}, serve_rows, peers.format_table(serve_rows), log_dir, "system", None, {})


if __name__ == "__main__":
    sys.exit(main())
