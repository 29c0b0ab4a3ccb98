"""benchmarks/spec_decode.py without servers: the counters, the per-token ITL, the table, the prompts."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_saved_path = list(sys.path)
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import serving
    import spec_decode
finally:
    sys.path[:] = _saved_path  # the script puts benchmarks/ first on the path; keep it off for other tests

METRICS_BEFORE = """\
# HELP aserve:spec_decode_num_drafts Speculative decoding: verify steps with drafts.
# TYPE aserve:spec_decode_num_drafts counter
aserve:spec_decode_num_drafts_total{model_name="SmolLM2"} 2.0
aserve:spec_decode_num_drafts_created{model_name="SmolLM2"} 1.7e9
aserve:spec_decode_num_draft_tokens_total{model_name="SmolLM2"} 8.0
aserve:spec_decode_num_accepted_tokens_total{model_name="SmolLM2"} 4.0
aserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2",position="0"} 3.0
aserve:generation_tokens_total{model_name="SmolLM2"} 100.0
"""

METRICS_AFTER = """\
# TYPE aserve:spec_decode_num_drafts counter
aserve:spec_decode_num_drafts_total{model_name="SmolLM2"} 102.0
aserve:spec_decode_num_drafts_created{model_name="SmolLM2"} 1.7e9
aserve:spec_decode_num_draft_tokens_total{model_name="SmolLM2"} 408.0
aserve:spec_decode_num_accepted_tokens_total{model_name="SmolLM2"} 304.0
aserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2",position="0"} 90.0
aserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2",position="1"} 80.0
"""

LLAMA_LOG = """\
slot print_timing: id 15 | draft acceptance = 0.43750 (   14 accepted /    32 generated), mean len =  2.75
0.01.57 I slot      release: id 15 | task 6 | stop processing: n_tokens = 306
slot print_timing: id 15 | draft acceptance = 0.55000 (   11 accepted /    20 generated), mean len =  3.20
slot print_timing: id 15 | draft acceptance = 0.00000 (    0 accepted /     8 generated), mean len =  1.00
"""


def test_counters_are_summed_by_name_without_created_per_pos_or_comments():
    assert spec_decode.parse_spec_metrics(METRICS_BEFORE) == {"spec_decode_num_drafts": 2.0,
                                                              "spec_decode_num_draft_tokens": 8.0,
                                                              "spec_decode_num_accepted_tokens": 4.0}
    # vllm: prefix, no _total suffix, several label sets (summed), a label value with a space and a brace
    text = ('vllm:spec_decode_num_drafts{model_name="a b}",engine="0"} 3\n'
            'vllm:spec_decode_num_drafts{model_name="c",engine="1"} 4\n'
            "spec_decode_num_draft_tokens 12.5\n")
    assert spec_decode.parse_spec_metrics(text) == {"spec_decode_num_drafts": 7.0,
                                                    "spec_decode_num_draft_tokens": 12.5}
    assert spec_decode.parse_spec_metrics("# nothing here\naserve:num_requests_running 1\n") == {}


def test_acceptance_and_mean_length_come_from_the_increase_over_the_pass():
    spec = spec_decode.spec_from_metrics(METRICS_BEFORE, METRICS_AFTER)
    assert spec["drafts"] == 100 and spec["draft_tokens"] == 400 and spec["accepted_tokens"] == 300
    assert spec["acceptance_rate"] == pytest.approx(0.75)
    assert spec["mean_accepted_length"] == pytest.approx(4.0)
    assert spec_decode.spec_from_metrics("", "aserve:num_requests_running 0\n") is None  # no speculation
    idle = spec_decode.spec_from_metrics(METRICS_BEFORE, METRICS_BEFORE)  # disabled by batch size
    assert idle["acceptance_rate"] is None and idle["mean_accepted_length"] is None


def test_llama_log_lines_are_summed():
    spec = spec_decode.spec_from_llama_log(LLAMA_LOG)
    assert spec["accepted_tokens"] == 25 and spec["draft_tokens"] == 60
    assert spec["acceptance_rate"] == pytest.approx(25 / 60)
    assert spec["drafts"] == pytest.approx(14 / 1.75 + 11 / 2.2)  # the request with mean len 1.00 is left out
    assert spec["mean_accepted_length"] == pytest.approx(1 + 25 / (8 + 5))
    assert spec_decode.spec_from_llama_log("no speculation here\n") is None


def test_itl_is_per_token_even_when_chunks_carry_several_tokens():
    # 9 tokens in 3 chunks (1 + 4 + 4): chunk gaps are 40 ms, per token 80 ms / 8 = 10 ms
    result = serving.RequestResult(ok=True, ttft=0.1, output_tokens=9, chunk_times=[1.0, 1.04, 1.08])
    assert result.itls == pytest.approx([0.04, 0.04])
    assert spec_decode.per_token_itl(result) == pytest.approx(0.01)
    one_token = serving.RequestResult(ok=True, output_tokens=1, chunk_times=[1.0])
    failed = serving.RequestResult(ok=False, output_tokens=5, chunk_times=[1.0, 2.0])
    assert spec_decode.per_token_itl(one_token) is None and spec_decode.per_token_itl(failed) is None


def _report(tok_s: float, ttft: float, itl: float | None, failed: int = 0) -> dict:
    return {"output_throughput": tok_s, "failed": failed, "num_prompts": 24, "total_output_tokens": 3000,
            "ttft_s": {"p50": ttft}, "itl_token_s": {"p50": itl}}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def test_table_rows_numbers_and_notes():
    rows = [
        {"system": "aserve-bf16", "concurrency": 1, "num_prompts": 24, "startup_s": 2.84,
         "report": _report(39.21, 0.4321, 0.02049)},
        {"system": "aserve-bf16-ngram", "concurrency": 16, "num_prompts": 48, "startup_s": 3.0,
         "spec": spec_decode.spec_summary(100, 400, 300), "report": _report(120.0, 0.9, None, failed=2)},
        {"system": "llama-bf16-lookup", "weights": "bf16 GGUF", "skipped": "no llama-server | binary"},
        {"system": "aserve-bf16-ngram", "concurrency": 1, "num_prompts": 24,
         "failed": "ServerError: server exited with code 2 before it was ready (log: x.log)"},
    ]
    lines = spec_decode.format_table(rows).splitlines()
    assert _cells(lines[0]) == list(spec_decode.COLUMNS) and len(lines) == 2 + len(rows)
    assert _cells(lines[2]) == ["aserve-bf16", "1", "24", "39.2", "0.43 s", "20.5 ms", "n/a", "n/a", "3000",
                                "2.8"]
    second = _cells(lines[3])
    assert second[3] == "120.0 (2 of 24 failed)" and second[5:8] == ["n/a", "75.0%", "4.00"]
    assert _cells(lines[4])[3] == "skipped: no llama-server \\| binary"
    assert _cells(lines[5])[:4] == ["aserve-bf16-ngram", "1", "24", _cells(lines[5])[3]]
    assert _cells(lines[5])[3].startswith("failed: ServerError")
    for line in lines[2:]:  # escaped pipes keep every row at the header's column count
        assert len(re.findall(r"(?<!\\)\|", line)) == len(spec_decode.COLUMNS) + 1


def test_prompts_are_fixed_varied_and_ground_their_answers_in_the_input():
    prompts = spec_decode.make_prompts()
    assert prompts == spec_decode.PROMPTS and len(prompts) == 24 and len(set(prompts)) == 24
    assert all(450 < len(p) < 2000 for p in prompts)  # 150-400 tokens with the chat template
    for code, old, new in spec_decode.FUNCTIONS:
        assert re.search(rf"\b{old}\b", code) and not re.search(rf"\b{new}\b", code)
    for text, _ in spec_decode.PARAGRAPHS:
        typo = spec_decode._typo(text)
        assert typo != text and len(typo) == len(text)
        assert sum(a != b for a, b in zip(typo, text, strict=True)) == 2
    batch = spec_decode.pass_prompts(48)
    assert len(set(batch)) == 48 and batch[24].endswith(prompts[0]) and batch[0].startswith("Task 1. ")


def test_speculative_config_and_systems_plan(monkeypatch):
    assert json.loads(spec_decode.speculative_config(4, 8)) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": 8}
    assert "disable_by_batch_size" not in json.loads(spec_decode.speculative_config(3, 0))
    monkeypatch.setattr(spec_decode.peers, "locate_weights", lambda model: ("/hf/Smol", "/m.gguf", ""))
    args = spec_decode.parse_args(["--llama-server", "/nonexistent/llama-server", "--num-spec-tokens", "5"])
    assert args.concurrency == [1, 16] and args.num_prompts == [24, 48] and args.max_tokens == 256
    systems = {s.key: s for s in spec_decode.plan(args)}
    assert list(systems) == list(spec_decode.SYSTEMS)
    ngram = systems["aserve-bf16-ngram"].argv
    assert ngram[ngram.index("--dtype") + 1] == "bfloat16"
    assert json.loads(ngram[ngram.index("--speculative-config") + 1])["num_speculative_tokens"] == 5
    lookup = systems["llama-bf16-lookup"]
    assert lookup.skipped and lookup.argv[-2:] == ["--spec-ngram-simple-size-m", "5"]
    with pytest.raises(SystemExit):
        spec_decode.parse_args(["--systems", "vllm"])
