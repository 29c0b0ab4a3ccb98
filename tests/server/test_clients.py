"""The black-box clients: benchmarks/serving.py and loadtest/locustfile.py against a real server."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_serving_benchmark_reports_throughput_and_latency(server, tmp_path, endpoint):
    out = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "serving.py"),
            "--base-url",
            server.url,
            "--endpoint",
            endpoint,
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--max-tokens",
            "6",
            "--prompt-words",
            "30",
            "--request-rate",
            "200",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_output_tokens"] == 12 * 6
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        stats = report[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], key
    assert "TTFT" in result.stdout and "output token throughput" in result.stdout


def test_serving_benchmark_dataset_is_seeded():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serving
    finally:
        sys.path.pop(0)
    a, b = serving.make_dataset(5, 200, seed=3), serving.make_dataset(5, 200, seed=3)
    assert a == b != serving.make_dataset(5, 200, seed=4)
    assert all(150 < len(p.split()) < 260 for p in a)


def test_serving_benchmark_guided_json_constrains_both_endpoints():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serving
    finally:
        sys.path.pop(0)
    chat = serving._body(serving.parse_args(["--endpoint", "chat", "--guided-json"]), "m", "p")
    assert chat["response_format"]["json_schema"]["schema"] == serving.GUIDED_SCHEMA
    completions = serving._body(serving.parse_args(["--guided-json"]), "m", "p")
    assert completions["guided_json"] == serving.GUIDED_SCHEMA
    plain = serving._body(serving.parse_args([]), "m", "p")
    assert "guided_json" not in plain and "response_format" not in plain


def test_locustfile_headless_reports_ttft_and_token_latency(server, tmp_path):
    # Never import locust here: it monkey-patches the process with gevent.
    locust = shutil.which("locust")
    if importlib.util.find_spec("locust") is None or locust is None:
        pytest.skip("locust is not installed (pip install -e '.[loadtest]')")
    prefix = tmp_path / "lt"
    result = subprocess.run(
        [
            locust,
            "-f",
            str(ROOT / "loadtest"),
            "--host",
            server.url,
            "--headless",
            "-u",
            "3",
            "-r",
            "3",
            "-t",
            "3s",
            "--max-tokens",
            "5",
            "--prompt-words",
            "20",
            "--only-summary",
            "--csv",
            str(prefix),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with open(f"{prefix}_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in (
        "chat.completions (stream)",
        "time_to_first_token",
        "time_per_output_token",
        "inter_token_latency",
    ):
        assert int(rows[name]["Request Count"]) > 0, name
        assert int(rows[name]["Failure Count"]) == 0, name
