"""`aserve bench serve | throughput | latency` end to end: a live tiny server, a tiny model offline."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from aserve.bench import cli
from aserve.bench.serve import result_path

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.server.real_tiny_server import build_tiny_chat_model, serving
    from tests.server.server_harness import quiet_args

    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_bench"))
    with serving(model, quiet_args()) as (_, address):
        yield address.url, model


def test_serve_sweep_writes_vllm_json_per_level_and_a_plot(tiny_server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    url, model = tiny_server
    png = tmp_path / "sweep.png"
    rc = cli.main(["serve", "--base-url", url, "--num-prompts", "8", "--random-input-len", "16",
                   "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "1,2", "--plot", str(png),
                   "--save-result", "--result-dir", str(tmp_path / "res"), "--result-filename", "run.json",
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                   "--disable-tqdm"])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "P90 ITL (ms):" in out
    for level in (1, 2):
        r = json.loads((tmp_path / "res" / f"run-concurrency{level}.json").read_text())
        assert r["max_concurrency"] == level and r["completed"] == 8 and r["failed"] == 0
        assert r["total_output_tokens"] == 8 * 4 and r["model_id"] == model and r["tokenizer_id"] == model
        assert r["backend"] == "openai" and r["request_rate"] == "inf" and r["burstiness"] == 1.0
        assert r["total_input_tokens"] >= 8 * 14
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        assert r["total_token_throughput"] == pytest.approx(
            (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < r[f"median_{metric}_ms"] <= r[f"p99_{metric}_ms"], metric
            assert f"mean_{metric}_ms" in r and f"std_{metric}_ms" in r and f"p90_{metric}_ms" in r
        assert r["p50_e2el_ms"] >= r["p50_ttft_ms"]


def test_serve_chat_backend_with_paced_bursty_arrivals(tiny_server, tmp_path):
    url, _ = tiny_server
    rc = cli.main(["serve", "--base-url", url, "--backend", "openai-chat", "--num-prompts", "4",
                   "--random-input-len", "8", "--random-output-len", "3", "--request-rate", "50",
                   "--burstiness", "0.5", "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert rc == 0
    (saved,) = tmp_path.glob("openai-chat-50.0qps-*.json")  # vLLM's default name, no concurrency part
    r = json.loads(saved.read_text())
    assert r["completed"] == 4 and r["request_rate"] == 50.0 and r["burstiness"] == 0.5


def test_default_result_name_is_vllms():
    args = type("A", (), {"result_filename": None, "result_dir": "d", "backend": "openai"})()
    r = {"max_concurrency": 4, "model_id": "org/Model-1", "request_rate": "inf", "date": "20260101-000000"}
    assert result_path(args, r, sweep=True) == "d/openai-infqps-concurrency4-Model-1-20260101-000000.json"


def test_bad_arguments_exit_2_with_the_flag_named(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--dataset-name", "sharegpt"])
    assert exc.value.code == 2 and "--dataset-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--percentile-metrics", "ttft,foo"])
    assert "foo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--max-concurrency", "1,0"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    with pytest.raises(SystemExit):
        cli.main(["serve", "--plot", "x.png"])
    assert "pip install 'aserve[bench]'" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_aserve_bench_is_dispatched_by_the_aserve_command():
    out = subprocess.run([sys.executable, "-m", "aserve.server.cli", "bench", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "--burstiness" in out.stdout and "--max-concurrency" in out.stdout


ENGINE = ["--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "64", "--num-gpu-blocks-override", "32",
          "--distributed-executor-backend", "uni"]


def test_throughput_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert cli.main(["throughput", "--model", tiny_llama, "--num-prompts", "5", "--input-len", "12",
                     "--output-len", "6", "--output-json", str(out), "--disable-tqdm", *ENGINE]) == 0
    r = json.loads(out.read_text())
    assert r["num_requests"] == 5 and r["total_output_tokens"] == 30
    assert r["total_num_tokens"] == 5 * 12 + 30
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(5 / r["elapsed_time"])
    assert "Throughput:" in capsys.readouterr().out


def test_latency_on_a_tiny_model(tiny_llama, tmp_path):
    out = tmp_path / "l.json"
    assert cli.main(["latency", "--model", tiny_llama, "--batch-size", "3", "--input-len", "8",
                     "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "3",
                     "--output-json", str(out), "--disable-tqdm", *ENGINE]) == 0
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 3 and all(x > 0 for x in r["latencies"])
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(r["latencies"]) <= r["percentiles"]["50"] <= max(r["latencies"])
    assert not math.isnan(r["percentiles"]["99"])
