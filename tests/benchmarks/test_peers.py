"""benchmarks/peers.py without real servers: the table, the config.json patch, the skip and failure rows."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import peers
finally:
    sys.path.pop(0)


def _stats(p50: float | None) -> dict:
    return {"mean": p50, "p50": p50, "p90": p50, "p99": p50}


def _report(tok_s: float, ttft: float, itl: float, tpot: float, failed: int = 0) -> dict:
    return {"output_throughput": tok_s, "failed": failed, "num_prompts": 48, "ttft_s": _stats(ttft),
            "itl_s": _stats(itl), "tpot_s": _stats(tpot)}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def test_table_has_one_line_per_row_with_formatted_numbers():
    rows = [
        {"system": "aserve", "weights": "bf16", "concurrency": 16, "startup_s": 4.26,
         "report": _report(110.14, 0.8049, 0.0151, 0.0162)},
        {"system": "llama.cpp", "weights": "Q4_1 | file", "concurrency": 1, "startup_s": 1.04,
         "report": _report(50.0, 0.2, 0.02, None, failed=2)},
        {"system": "llama.cpp", "weights": "bf16 GGUF", "skipped": "no llama-server binary"},
        {"system": "transformers serve", "weights": "HF", "concurrency": 16, "startup_s": None,
         "failed": "ServerError: not ready after 600 s (log: x.log)"},
    ]
    lines = peers.format_table(rows).splitlines()
    assert _cells(lines[0]) == list(peers.COLUMNS)
    assert len(lines) == 2 + len(rows)
    assert _cells(lines[2]) == ["aserve", "bf16", "16", "110.1", "0.80 s", "15.1 ms", "16.2 ms", "4.3"]
    third = _cells(lines[3])
    assert third[1] == "Q4_1 \\| file" and third[3] == "50.0 (2 of 48 failed)" and third[6] == "n/a"
    assert _cells(lines[4])[:4] == ["llama.cpp", "bf16 GGUF", "", "skipped: no llama-server binary"]
    assert _cells(lines[5])[3].startswith("failed: ServerError: not ready")
    for line in lines[2:]:  # escaped pipes keep every row at the header's column count
        assert len(re.findall(r"(?<!\\)\|", line)) == len(peers.COLUMNS) + 1


def test_rope_theta_is_copied_to_the_top_level_without_touching_the_input():
    config = {"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    patched = peers.patch_rope_theta(config)
    assert patched["rope_theta"] == 100000.0 and "rope_theta" not in config
    assert peers.patch_rope_theta({"rope_theta": 5.0, "rope_parameters": {"rope_theta": 7.0}})["rope_theta"] == 5.0
    assert "rope_theta" not in peers.patch_rope_theta({"model_type": "gpt2"})


def test_cpu_summary_names_the_model_count_and_bf16_flags():
    info = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 avx512_bf16\n\n" \
           "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 avx512_bf16\n"
    assert peers.cpu_summary(info) == ("Test CPU 9000 (2 logical CPUs; avx2 yes, avx512f no, "
                                       "avx512_bf16 yes, amx_bf16 no)")
    assert peers.cpu_summary("").startswith("unknown CPU")


def test_concurrency_and_prompt_counts_pair_up():
    args = peers.parse_args(["--concurrency", "1,4,16", "--num-prompts", "6"])
    assert args.concurrency == [1, 4, 16] and args.num_prompts == [6, 6, 6]
    assert peers.parse_args([]).num_prompts == [8, 48]
    with pytest.raises(SystemExit):
        peers.parse_args(["--concurrency", "1,16", "--num-prompts", "1,2,3"])
    with pytest.raises(SystemExit):
        peers.parse_args(["--systems", "aserve-bf16,vllm"])


def _executable(path: Path) -> str:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_missing_binaries_and_files_become_skip_reasons(tmp_path, monkeypatch):
    monkeypatch.setattr(peers.shutil, "which", lambda name: None)
    args = peers.parse_args(["--llama-server", str(tmp_path / "nope"),
                             "--llama-bf16-gguf", str(tmp_path / "missing.gguf")])
    systems = {s.key: s for s in peers.plan_systems(args, "/hf", "/m.Q4_1.gguf", "")}
    assert list(systems) == list(peers.SYSTEMS)
    assert systems["aserve-bf16"].skipped == systems["aserve-gguf"].skipped == "no `aserve` on PATH"
    assert "no llama-server binary at" in systems["llama-q4_1"].skipped
    assert "transformers" in systems["transformers"].skipped
    assert "no --vllm-python" in systems["vllm-bf16"].skipped


def test_the_vllm_row_runs_its_python_on_the_hf_folder_or_says_why_not(tmp_path):
    args = peers.parse_args(["--systems", "vllm-bf16", "--vllm-python", sys.executable])
    (broken,) = peers.plan_systems(args, "/hf", "", "")
    assert "cannot import vLLM" in broken.skipped  # this environment has no vLLM
    fake = tmp_path / "python"  # a Python whose `-c` probe succeeds
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    args = peers.parse_args(["--systems", "vllm-bf16", "--vllm-python", str(fake), "--vllm-args=--max-model-len 512"])
    (vllm,) = peers.plan_systems(args, "/hf", "", "")
    assert vllm.skipped == ""
    assert vllm.argv == [str(fake), "-m", "vllm.entrypoints.openai.api_server", "--model", "/hf", "--dtype",
                         "bfloat16", "--max-model-len", "512"]


def test_available_systems_get_their_commands(tmp_path, monkeypatch):
    aserve = _executable(tmp_path / "aserve")
    llama = _executable(tmp_path / "llama-server")
    monkeypatch.setattr(peers.shutil, "which", lambda name: aserve if name == "aserve" else None)
    args = peers.parse_args(["--llama-server", llama, "--llama-bf16-gguf", str(tmp_path / "b.gguf"),
                             "--systems", "aserve-gguf,llama-bf16,llama-q4_1"])
    systems = {s.key: s for s in peers.plan_systems(args, "/hf", "/m.Q4_1.gguf", "")}
    assert list(systems) == ["aserve-gguf", "llama-bf16", "llama-q4_1"]
    assert systems["aserve-gguf"].argv == [aserve, "--quantization", "gguf", "--disable-log-requests"]
    assert "--make-bf16-gguf" in systems["llama-bf16"].skipped
    assert systems["llama-q4_1"].skipped == ""
    assert systems["llama-q4_1"].argv == [llama, "-m", "/m.Q4_1.gguf", "-t", "2", "-np", "16", "-c", "65536"]
    assert args.llama_cpp_src == str(tmp_path.parent.parent)


def test_a_model_that_is_not_gguf_skips_only_the_gguf_rows(monkeypatch):
    monkeypatch.setattr(peers.shutil, "which", lambda name: "/bin/" + name)
    args = peers.parse_args(["--model", "org/model", "--systems", "aserve-bf16,aserve-gguf"])
    bf16, gguf = peers.plan_systems(args, "/hf", "", "--model org/model is not a .gguf file")
    assert bf16.skipped == "" and bf16.argv[:3] == ["/bin/aserve", "--model", "org/model"]
    assert gguf.skipped == "--model org/model is not a .gguf file"


def test_a_server_that_exits_early_gives_a_failed_row(tmp_path):
    system = peers.System("crash", "crash", "none", [sys.executable, "-c", "raise SystemExit(3)"])
    args = peers.parse_args(["--startup-timeout", "60"])
    row = peers.run_pass(system, args, 1, 2, str(tmp_path))
    assert "exited with code 3" in row["failed"] and "report" not in row
    assert os.path.exists(tmp_path / "crash-c1.log")


def test_main_prints_skipped_rows_instead_of_crashing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers, "locate_weights", lambda model: ("/hf", "/m.Q4_1.gguf", ""))
    out = tmp_path / "peers.json"
    code = peers.main(["--systems", "llama-q4_1", "--llama-server", str(tmp_path / "none"),
                       "--log-dir", str(tmp_path), "--json-out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| llama.cpp | m.Q4_1.gguf |  | skipped: no llama-server binary at" in printed
    assert "cpu: " in printed and "command: benchmarks/peers.py --systems llama-q4_1" in printed
    assert json.loads(out.read_text())["rows"][0]["skipped"].startswith("no llama-server binary")


def test_bf16_conversion_runs_on_a_patched_copy(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 10.0}}))
    (hf / "model.safetensors").write_text("weights")
    src = tmp_path / "llama.cpp"
    src.mkdir()
    # a stand-in converter: records what it was given into --outfile
    (src / "convert_hf_to_gguf.py").write_text(
        "import json, os, sys\n"
        "folder, out = sys.argv[1], sys.argv[sys.argv.index('--outfile') + 1]\n"
        "cfg = json.load(open(os.path.join(folder, 'config.json')))\n"
        "json.dump({'argv': sys.argv[2:], 'rope_theta': cfg.get('rope_theta'),\n"
        "           'weights': open(os.path.join(folder, 'model.safetensors')).read()}, open(out, 'w'))\n")
    monkeypatch.setattr(peers, "_missing_modules", lambda names: [])
    out = tmp_path / "out" / "m-bf16.gguf"
    assert peers.make_bf16_gguf(str(hf), str(out), str(src)) == 0
    seen = json.loads(out.read_text())
    assert seen["rope_theta"] == 10.0 and seen["weights"] == "weights"
    assert seen["argv"][:2] == ["--outtype", "bf16"]
    assert "rope_theta" not in json.loads((hf / "config.json").read_text())
    assert peers.make_bf16_gguf(str(hf), str(out), str(tmp_path / "nowhere")) == 2


def test_the_weight_stream_bound_counts_every_projection_and_the_lm_head(tmp_path):
    import _weight_bound

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 500}))
    per_layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 96  # q|k|v, o, gate|up and down
    assert _weight_bound.bf16_decode_bytes(str(tmp_path)) == 2 * (2 * per_layer + 500 * 64)
    assert _weight_bound.dram_read_gbps(mib=16, repeats=1) > 0
    assert "unknown" in _weight_bound.weight_bound_line(str(tmp_path / "missing"))


def test_rounds_merge_into_medians_and_keep_skipped_and_all_failed_passes():
    def row(tok_s, itl, startup, failed=None):
        r = {"system": "aserve", "key": "aserve-bf16", "weights": "bf16", "concurrency": 1, "num_prompts": 48,
             "startup_s": startup, "report": _report(tok_s, 0.3, itl, itl)}
        if failed:
            r["failed"] = failed
        return r

    skipped = {"system": "llama.cpp", "key": "llama-bf16", "weights": "bf16 GGUF", "skipped": "no binary"}
    rounds = [[row(100.0, 0.010, 3.0), skipped, row(1.0, 1.0, 1.0, failed="boom")],
              [row(120.0, 0.014, 5.0), skipped, row(1.0, 1.0, 1.0, failed="boom again")],
              [row(90.0, 0.012, 4.0, failed="ServerError"), skipped, row(1.0, 1.0, 1.0, failed="boom")]]
    merged = peers.merge_rounds(rounds)
    assert len(merged) == 3
    first = merged[0]
    assert first["rounds_ok"] == 2 and "failed" not in first
    assert first["report"]["output_throughput"] == pytest.approx(110.0)  # the failed round left out
    assert first["report"]["itl_s"]["p50"] == pytest.approx(0.012) and first["startup_s"] == pytest.approx(4.0)
    assert merged[1] is skipped
    assert merged[2]["failed"] == "boom"  # failed every round: the first round's row
    assert "| 110.0 | 0.30 s | 12.0 ms |" in peers.format_table(merged)
