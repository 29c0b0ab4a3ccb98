"""Speculative decoding benchmark (issue 22): ITL on an input-grounded workload, aserve with and without
n-gram speculation against llama.cpp's server with and without its lookup decoding. Not part of CI.

    python benchmarks/peers.py --llama-server PATH/llama-server --make-bf16-gguf   # once: HF -> bf16 GGUF
    python benchmarks/spec_decode.py --llama-server PATH/llama-server --json-out spec.json

Each pass: a fresh server (peers.py's machinery), a warm-up request, then the 24 prompts below, whose
answers mostly copy spans of the prompt (rename a variable, fix a typo, quote the sentences that say X,
summarise with quotes; 150-400 tokens): chat, greedy, EOS honoured. Rows: aserve-bf16 (`--dtype bfloat16`),
aserve-bf16-ngram (plus `--speculative-config '{"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": B}'`; B has no effect at c=1),
llama-bf16 (llama-server, bf16 GGUF), llama-bf16-lookup (plus --llama-lookup-args: ngram-simple lookup).

The table's ITL is **per output token**: per request (last content chunk's time - first's) / (output
tokens - 1), p50 over requests; serving.py's per-chunk ITL (with speculation one chunk carries several
tokens) stays in the JSON as `itl_s`. Acceptance rate = accepted / drafted tokens, mean accepted length =
1 + accepted / drafts: for aserve from the spec_decode_num_{drafts,draft_tokens,accepted_tokens} counters
of GET /metrics (increase over the pass), for llama.cpp from its per-request "draft acceptance" log lines
(its drafts recovered from the rounded mean lengths; requests with none accepted left out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shlex
import sys
import tempfile
import time

import httpx

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # peers.py / serving.py (scripts' modules) and the repository
import peers
import serving

SYSTEMS = ("aserve-bf16", "aserve-bf16-ngram", "llama-bf16", "llama-bf16-lookup")
COLUMNS = ("system", "c", "prompts", "output tok/s", "TTFT p50", "ITL p50 (per token)", "acceptance",
           "mean accepted len", "output tokens", "start-up s")
LLAMA_LOOKUP = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m {k}"
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")

# (paragraph, what the sentence that a quote task asks for says)
PARAGRAPHS = [
    (("The lighthouse on Gull Point was built in 1871 from granite quarried on the island itself. For sixty "
     "years its lamp burned whale oil and then kerosene, and the keeper climbed the one hundred and twelve "
     "steps four times every night to trim the wick. In 1932 the lamp was replaced by an electric beacon that"
     " could be seen twenty-two nautical miles out to sea. The last keeper, Martha Quill, left in 1961 when "
     "the light was automated, and she later wrote that the silence of the tower was the thing she missed "
     "most. Today the keeper's cottage is a small museum, open from May to September, and the tower can be "
     "climbed on the first Sunday of each month."), "how far out to sea the electric beacon could be seen"),
    (("A sourdough starter is a living culture of wild yeast and lactic acid bacteria. To begin one, mix "
     "equal weights of whole rye flour and lukewarm water in a clean jar and leave it loosely covered at "
     "room temperature. Every twenty-four hours, discard half of the mixture and feed it again with fresh "
     "flour and water. After five to seven days the starter should double in size within six hours of a "
     "feeding and smell pleasantly sour, like yogurt or green apples. If a grey liquid forms on top, the "
     "starter is hungry; pour it off and feed it more often. Once it is active, it can be kept in the "
     "refrigerator and fed once a week."), "what a grey liquid on top of the starter means"),
    (("The city of Arden draws its drinking water from two reservoirs in the hills to the north. Water flows "
     "by gravity through a tunnel eleven kilometres long to the treatment plant at Millbrook, where it is "
     "filtered through sand and activated carbon and disinfected with ultraviolet light. A small dose of "
     "chlorine is then added so that the water stays safe on its way through the pipes. The plant treats "
     "about ninety million litres on an average day and up to one hundred and forty million in a hot summer. "
     "Residents can read the monthly water quality report on the council's website or ask for a printed copy "
     "at any public library."), "how much water the plant treats on an average day"),
    (("Version 3.2 of the Fernwood editor changes how files are saved. Until now, saving wrote the new "
     "content directly over the old file, so a crash in the middle of a save could leave a file half "
     "written. Fernwood now writes the content to a temporary file in the same folder and renames it over "
     "the original only when the write has finished. The release also adds a setting that keeps the last "
     "five versions of every file in a hidden history folder. Plugins that hook into saving must be updated,"
     " because the save event now fires after the rename rather than before it. The full list of changes is "
     "in the release notes."), "why plugins that hook into saving must be updated"),
    (("The Hollow Ridge trail is a loop of fourteen kilometres that climbs four hundred metres through "
     "beech and pine forest. It starts at the car park beside the old mill and is marked with yellow "
     "arrows on wooden posts. The steepest section comes after the second bridge, where the path zigzags "
     "up to a rocky viewpoint over the valley. Most walkers take five to six hours, including a stop for "
     "lunch at the viewpoint. There is no drinking water on the route, so carry at least two litres per "
     "person. In winter the upper section can be icy, and the park service closes it after heavy "
     "snowfall."), "what walkers must carry because there is no water on the route"),
    (("Lithium iron phosphate batteries store less energy per kilogram than the nickel-rich cells used in "
     "most electric cars, but they last much longer and are far less likely to catch fire. A typical cell"
     " keeps eighty percent of its capacity after three thousand full charge cycles. Because the "
     "chemistry contains no cobalt or nickel, the cells are also cheaper to make. Their main weakness is "
     "cold: below freezing, they charge slowly and should be warmed before fast charging. For home "
     "storage and city buses, where weight matters less than lifetime and safety, they have become the "
     "most common choice."), "what the main weakness of these batteries is"),
    (("Members of the Eastfield Public Library may borrow up to twenty items at a time. Books can "
     "be kept for three weeks and renewed twice online or by phone, unless another member has "
     "reserved them. Films and games are lent for one week and cannot be renewed. There are no "
     "fines for late returns, but a member with an item more than thirty days overdue cannot "
     "borrow anything else until it is returned. Lost or damaged items are charged at the price of"
     " a replacement. Children under twelve need a parent or guardian to sign their membership "
     "form."), "what happens to a member with an item more than thirty days overdue"),
    (("The new gallery at the Marlow Museum tells the story of the river through two hundred objects found in"
     " its mud. The oldest is a bronze sword from about 1200 BC, bent in half before it was thrown into the "
     "water, probably as an offering. Nearby cases hold Roman coins, medieval pilgrim badges and a wooden "
     "toy boat from the nineteenth century. Most of the objects were found by volunteers who search the "
     "foreshore at low tide with a permit from the port authority. Entry to the gallery is free, and guided "
     "tours run every Saturday at eleven."), "who found most of the objects"),
]

# (function, variable to rename, new name)
FUNCTIONS = [
    (("def moving_average(values, window):\n    result = []\n    total = 0.0\n"
     "    for i, x in enumerate(values):\n        total += x\n        if i >= window:\n"
     "            total -= values[i - window]\n        if i >= window - 1:\n"
     "            result.append(total / window)\n    return result\n"), "total", "running_sum"),
    (("def parse_config(text):\n    config = {}\n"
     "    for line_no, line in enumerate(text.splitlines(), 1):\n        line = line.strip()\n"
     "        if not line or line.startswith('#'):\n            continue\n        if '=' not in line:\n"
     "            raise ValueError(f'line {line_no}: expected key = value')\n"
     "        key, value = line.split('=', 1)\n        config[key.strip()] = value.strip()\n"
     "    return config\n"), "config", "settings"),
    (("def merge_intervals(intervals):\n    ordered = sorted(intervals, key=lambda pair: pair[0])\n"
     "    merged = []\n    for start, end in ordered:\n        if merged and start <= merged[-1][1]:\n"
     "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n"
     "            merged.append([start, end])\n    return [tuple(pair) for pair in merged]\n"),
     "merged", "result"),
    (("def word_frequencies(text, stop_words=()):\n    counts = {}\n    for word in text.lower().split():\n"
     "        word = word.strip('.,;:!?\"()')\n        if not word or word in stop_words:\n"
     "            continue\n        counts[word] = counts.get(word, 0) + 1\n"
     "    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))\n"), "counts", "frequency"),
    (("def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n"
     "        middle = (low + high) // 2\n        if items[middle] == target:\n            return middle\n"
     "        if items[middle] < target:\n            low = middle + 1\n        else:\n"
     "            high = middle - 1\n    return -1\n"), "middle", "mid"),
    (("def retry(call, attempts=3, delay=0.5):\n    last_error = None\n"
     "    for attempt in range(attempts):\n        try:\n            return call()\n"
     "        except OSError as error:\n            last_error = error\n"
     "            time.sleep(delay * (2 ** attempt))\n"
     "    raise RuntimeError(f'failed after {attempts} attempts') from last_error\n"),
     "last_error", "previous"),
]


def _typo(text: str) -> str:
    """`text` with the 3rd and 4th letters of its first word of 8+ letters swapped (the typo to fix)."""
    i = re.search(r"\b[a-z]{8,}\b", text).start()
    return text[:i + 2] + text[i + 3] + text[i + 2] + text[i + 4:]


def make_prompts() -> list[str]:
    """The 24 input-grounded prompts, in a fixed order (code edits, typo fixes, quotes, summaries)."""
    keep = "Keep the indentation, the blank lines and every other line exactly as they are."
    prompts = [f"Rename the variable `{old}` to `{new}` in this Python function and return the whole "
               f"function in a code block. {keep}\n\n```python\n{code}```" for code, old, new in FUNCTIONS]
    prompts += [f"Add a one-line docstring saying what it returns to this Python function and return the "
                f"whole function in a code block. {keep}\n\n```python\n{c}```" for c, *_ in FUNCTIONS[:2]]
    prompts += ["The paragraph below contains one spelling mistake. Fix it and return the whole corrected "
                f"paragraph, word for word otherwise.\n\n{_typo(text)}" for text, _ in PARAGRAPHS]
    for i in range(0, len(PARAGRAPHS), 2):
        a, b = PARAGRAPHS[i], PARAGRAPHS[i + 1]
        prompts.append(f"Read the two texts below.\n\nText A: {a[0]}\n\nText B: {b[0]}\n\nQuote, word for "
                       f"word, the sentence of text A that says {a[1]}, then the sentence of text B that "
                       f"says {b[1]}.")
    for i in range(1, len(PARAGRAPHS), 2):
        a, b = PARAGRAPHS[i], PARAGRAPHS[(i + 1) % len(PARAGRAPHS)]
        prompts.append("Summarise the text below in four bullet points. Each bullet must quote, word for "
                       f"word and in double quotes, the sentence it is based on.\n\n{a[0]}\n\n{b[0]}")
    return prompts


PROMPTS = make_prompts()


def pass_prompts(num_prompts: int) -> list[str]:
    """Prompt i of a pass: a distinct "Task i." prefix on PROMPTS[i % len(PROMPTS)]."""
    return [f"Task {i + 1}. {PROMPTS[i % len(PROMPTS)]}" for i in range(num_prompts)]


def per_token_itl(result: serving.RequestResult) -> float | None:
    """(last content chunk - first content chunk) / (output tokens - 1), or None below 2 tokens."""
    if not result.ok or result.output_tokens < 2 or not result.chunk_times:
        return None
    return (result.chunk_times[-1] - result.chunk_times[0]) / (result.output_tokens - 1)


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')


def parse_spec_metrics(text: str) -> dict[str, float]:
    """Sums of the spec-decode counters in a Prometheus text (any prefix, `_total` or not, all labels)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        base = match.group(1).rsplit(":", 1)[-1].removesuffix("_total") if match else ""
        if base in SPEC_COUNTERS:  # not _created, _per_pos or comments
            totals[base] = totals.get(base, 0.0) + float(match.group(2))
    return totals


def spec_summary(drafts: float, draft_tokens: float, accepted: float) -> dict:
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1.0 + accepted / drafts if drafts else None}


def spec_from_metrics(before: str, after: str) -> dict | None:
    """The counters' increase between two /metrics texts; None if the server has no such counters."""
    b, a = parse_spec_metrics(before), parse_spec_metrics(after)
    return spec_summary(*(a.get(k, 0.0) - b.get(k, 0.0) for k in SPEC_COUNTERS)) if a else None


_LLAMA_DRAFT = re.compile(r"draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated\), "
                          r"mean len =\s*([\d.]+)")


def spec_from_llama_log(text: str) -> dict | None:
    """llama-server's per-request "draft acceptance" lines, summed; None if there are none."""
    lines = _LLAMA_DRAFT.findall(text)
    accepted, drafted = sum(int(a) for a, _, _ in lines), sum(int(g) for _, g, _ in lines)
    drafts = sum(int(a) / (float(n) - 1.0) for a, _, n in lines if float(n) > 1.0)
    return spec_summary(drafts, drafted, accepted) if lines else None


def speculative_config(k: int, disable_by_batch_size: int) -> str:
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if disable_by_batch_size > 0:
        config["disable_by_batch_size"] = disable_by_batch_size
    return json.dumps(config)


def plan(args: argparse.Namespace) -> list[peers.System]:
    """peers.py's aserve-bf16 and llama-bf16 systems, and their speculative variants."""
    peer_args = peers.parse_args([
        "--systems", "aserve-bf16,llama-bf16", "--model", args.model, f"--aserve-args={args.aserve_args}",
        f"--llama-args={args.llama_args}", "--llama-server", args.llama_server,
        "--llama-bf16-gguf", args.llama_bf16_gguf])
    base = {s.key: s for s in peers.plan_systems(peer_args, *peers.locate_weights(args.model))}
    asv, llama = base["aserve-bf16"], base["llama-bf16"]
    spec = speculative_config(args.num_spec_tokens, args.disable_by_batch_size)
    lookup = shlex.split(args.llama_lookup_args.format(k=args.num_spec_tokens))
    systems = {
        "aserve-bf16": asv,
        "aserve-bf16-ngram": peers.System("aserve-bf16-ngram", "aserve ngram", "bf16",
                                          [*asv.argv, "--speculative-config", spec], skipped=asv.skipped),
        "llama-bf16": llama,
        "llama-bf16-lookup": peers.System("llama-bf16-lookup", "llama.cpp lookup", llama.weights,
                                          [*llama.argv, *lookup], skipped=llama.skipped),
    }
    return [systems[k] for k in SYSTEMS if k in args.systems]


async def measure(base_url: str, prompts: list[str], concurrency: int, max_tokens: int,
                  timeout: float) -> dict:
    """serving.py's client over `prompts` at `concurrency`: its report plus the per-token ITL."""
    sargs = serving.parse_args(["--base-url", base_url, "--endpoint", "chat", "--max-tokens", str(max_tokens),
                                "--temperature", "0", "--max-concurrency", str(concurrency),
                                "--num-prompts", str(len(prompts)), "--timeout", str(timeout)])
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:  # the semaphore limits it
        model = await serving.resolve_model(client, "")
        semaphore = asyncio.Semaphore(concurrency)

        async def one(prompt: str) -> serving.RequestResult:
            async with semaphore:
                return await serving.one_request(client, sargs, model, prompt)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
    report = serving.summarize(list(results), duration, model, sargs)
    report["itl_token_s"] = serving._percentiles([t for r in results if (t := per_token_itl(r)) is not None])
    return report


def run_pass(system: peers.System, args: argparse.Namespace, concurrency: int, num_prompts: int,
             log_dir: str) -> dict:
    """One fresh server: start-up time, a warm-up request, the measured pass, the spec-decode counts."""
    row = {"system": system.key, "weights": system.weights, "concurrency": concurrency,
           "num_prompts": num_prompts}

    offset = {}

    def run(base_url: str, log_path: str) -> None:
        warm = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."]
        asyncio.run(measure(base_url, warm, 1, 8, args.request_timeout))
        before, offset[log_path] = httpx.get(base_url + "/metrics").text, os.path.getsize(log_path)
        row["report"] = asyncio.run(measure(base_url, pass_prompts(num_prompts), concurrency, args.max_tokens,
                                            args.request_timeout))
        row["spec"] = spec_from_metrics(before, httpx.get(base_url + "/metrics").text)  # llama: 501

    peers.on_fresh_server(system, args, concurrency, log_dir, row, run)
    if system.key.startswith("llama") and "report" in row:  # llama.cpp reports its drafts in its log
        ((log_path, log_offset),) = offset.items()
        with open(log_path, "rb") as f:
            row["spec"] = spec_from_llama_log(f.read()[log_offset:].decode(errors="replace"))
    return row


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_table(rows: list[dict]) -> str:
    """One markdown line per row: its numbers, or "skipped: why" / "failed: why"."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for row in rows:
        if "skipped" in row or "failed" in row:
            note = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['failed']}"
            cells = [str(row.get("concurrency", "")), str(row.get("num_prompts", "")), note, *[""] * 6]
        else:
            report, spec = row["report"], row.get("spec") or {}
            tok_s = f"{report['output_throughput']:.1f}"
            if report["failed"]:
                tok_s += f" ({report['failed']} of {report['num_prompts']} failed)"
            itl = report["itl_token_s"]["p50"]
            cells = [str(row["concurrency"]), str(row["num_prompts"]), tok_s,
                     _fmt(report["ttft_s"]["p50"], ".2f", " s"),
                     _fmt(None if itl is None else itl * 1000, ".1f", " ms"),
                     _fmt(spec.get("acceptance_rate"), ".1%"), _fmt(spec.get("mean_accepted_length"), ".2f"),
                     str(report["total_output_tokens"]), _fmt(row.get("startup_s"), ".1f")]
        lines.append("| " + " | ".join(t.replace("|", "\\|") for t in [row["system"], *cells]) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument("--model", default="", help="passed to aserve (default: the bundled SmolLM2)")
    p.add_argument("--concurrency", default="1,16", help="one pass per value, on a fresh server: %(default)s")
    p.add_argument("--num-prompts", default="24,48", help="per pass: one value or one per --concurrency")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-spec-tokens", type=int, default=4, help="drafted tokens per step (K)")
    p.add_argument("--disable-by-batch-size", type=int, default=8,
                   help="disable_by_batch_size in aserve's --speculative-config (0: left out): %(default)s")
    p.add_argument("--aserve-args", default="--disable-log-requests", help="write --aserve-args=...")
    p.add_argument("--llama-server", default="", help="llama-server binary (default: llama-server on PATH)")
    p.add_argument("--llama-bf16-gguf", default="", help="default: as peers.py (~/.cache/aserve/peers/)")
    p.add_argument("--llama-args", default="-t 2 -np 16 -c 65536", help="llama-server flags: %(default)s")
    p.add_argument("--llama-lookup-args", default=LLAMA_LOOKUP,
                   help="llama-bf16-lookup's extra flags ({k}: --num-spec-tokens): %(default)s")
    for name, default in (("startup-timeout", 600.0), ("request-timeout", 600.0), ("stop-grace", 30.0)):
        p.add_argument(f"--{name}", type=float, default=default, help="seconds: %(default)s")
    p.add_argument("--log-dir", default="", help="server logs (default: a new temporary folder)")
    p.add_argument("--json-out", default=None, help="also write everything as JSON to this file")
    args = p.parse_args(argv)
    peers.check_pass_args(p, args, SYSTEMS)
    if min(args.num_spec_tokens, args.max_tokens) < 1:
        p.error("--num-spec-tokens, --max-tokens: values must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="aserve-spec-")
    os.makedirs(log_dir, exist_ok=True)
    rows = peers.run_systems(plan(args), args, log_dir, run_pass,
                             lambda s: {"system": s.key, "weights": s.weights, "skipped": s.skipped})
    info = {
        "cpu": peers.cpu_summary(peers._read_cpuinfo()),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/spec_decode.py",
                               *(sys.argv[1:] if argv is None else argv)]),
        "workload": (f"{len(PROMPTS)} input-grounded chat prompts, at most {args.max_tokens} output tokens, "
                     f"greedy, EOS honoured, K={args.num_spec_tokens}; ITL per output token"),
    }
    return peers.report(info, rows, format_table(rows), log_dir, "system", args.json_out, {"prompts": PROMPTS})


if __name__ == "__main__":
    sys.exit(main())
