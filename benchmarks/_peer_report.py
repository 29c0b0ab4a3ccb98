"""The peer benchmarks' result rows (benchmarks/peers.py and the scripts built on it): the markdown
table, rounds merged into medians, and the printed / JSON report."""

from __future__ import annotations

import json
import statistics

COLUMNS = ("system", "weights", "c", "output tok/s", "TTFT p50", "ITL p50", "TPOT p50", "start-up s")


def _ms(stats: dict) -> str:
    return "n/a" if stats.get("p50") is None else f"{stats['p50'] * 1000:.1f} ms"


def format_table(rows: list[dict]) -> str:
    """The markdown table: one row per system and concurrency, or one "skipped"/"failed" row."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 2 + "---:|" * (len(COLUMNS) - 2)]
    for row in rows:
        c = str(row.get("concurrency", "")) if "skipped" not in row else ""
        startup = f"{row['startup_s']:.1f}" if row.get("startup_s") is not None else ""
        if "skipped" in row or "failed" in row:
            note = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['failed']}"
            cells = [note, "", "", "", startup]
        else:
            report = row["report"]
            tok_s = f"{report['output_throughput']:.1f}"
            if report["failed"]:
                tok_s += f" ({report['failed']} of {report['num_prompts']} failed)"
            ttft = report["ttft_s"].get("p50")
            cells = [tok_s, "n/a" if ttft is None else f"{ttft:.2f} s", _ms(report["itl_s"]),
                     _ms(report["tpot_s"]), startup]
        texts = [row["system"], row["weights"], c, *cells]
        lines.append("| " + " | ".join(t.replace("|", "\\|") for t in texts) + " |")
    return "\n".join(lines)


def _median_p50(reports: list[dict], field: str) -> dict:
    values = [r[field].get("p50") for r in reports if r[field].get("p50") is not None]
    return {"p50": statistics.median(values) if values else None}


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per (system, concurrency) of the first round: each number the median over the rounds in
    which that pass succeeded (`rounds_ok` of `len(rounds)`); a pass that failed in every round keeps
    the first round's failed row. The JSON keeps every round's rows besides."""
    merged = []
    for i, first in enumerate(rounds[0]):
        passes = [r[i] for r in rounds if "report" in r[i] and "failed" not in r[i]]
        if "skipped" in first or not passes:
            merged.append(first)
            continue
        reports = [p["report"] for p in passes]

        startups = [p["startup_s"] for p in passes if p.get("startup_s") is not None]
        row = {k: v for k, v in first.items() if k not in ("report", "failed", "startup_s")}
        row["startup_s"] = statistics.median(startups) if startups else None
        row["rounds_ok"] = len(passes)
        row["report"] = {"output_throughput": statistics.median(r["output_throughput"] for r in reports),
                         "failed": max(r["failed"] for r in reports), "num_prompts": reports[0]["num_prompts"],
                         "ttft_s": _median_p50(reports, "ttft_s"), "itl_s": _median_p50(reports, "itl_s"),
                         "tpot_s": _median_p50(reports, "tpot_s")}
        merged.append(row)
    return merged


def report(info: dict, rows: list[dict], table: str, log_dir: str, name_field: str, json_out: str | None,
           json_extra: dict) -> int:
    """Prints the run's facts, `table` and each pass's command; writes the JSON; 1 if any pass failed."""
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    print(f"server logs: {log_dir}\n")
    print(table)
    for row in rows:
        if "command" in row:
            print(f"- {row[name_field]} c={row['concurrency']}: `{row['command']}`")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({**info, **json_extra, "rows": rows}, f, indent=2)
    return 1 if any("failed" in r or r.get("report", {}).get("failed") for r in rows) else 0
