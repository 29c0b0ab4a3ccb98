"""`aserve --help`: grouped as vLLM groups its flags, every flag described with its real default (once),
and `--help=<group>` / `--help=listgroup` (issue 25)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from aserve.config import EngineArgs
from aserve.config.vllm_compat import COMPAT_ARGS
from aserve.server.args import make_parser
from aserve.server.help_groups import FLAG_GROUPS, GROUPS

_RESOLVE_PY = Path(__file__).resolve().parents[2] / "aserve" / "config" / "resolve.py"
# Fields whose None default resolve_config replaces: `args.X or ...` / `if args.X is None` / `X = args.X` then
# `if X is None` (read from the source, so a new resolved default is caught too), plus the known ones.
_KNOWN_RESOLVED = {"max_model_len", "tokenizer", "served_model_name", "cpu_kvcache_space", "max_num_batched_tokens",
                   "enable_chunked_prefill", "preemption_mode", "distributed_executor_backend", "attention_backend",
                   "compilation_config"}


def _resolved_fields() -> set[str]:
    src = _RESOLVE_PY.read_text()
    found = set(re.findall(r"args\.(\w+) or\b", src)) | set(re.findall(r"args\.(\w+) is None", src))
    for local, field in re.findall(r"(\w+) = args\.(\w+)\n", src):
        if re.search(rf"\b{local} is None", src):
            found.add(field)
    none_default = {f.name for f in dataclasses.fields(EngineArgs) if f.default is None}
    return (found & none_default) | _KNOWN_RESOLVED


def _help_text(serve: bool = False) -> str:
    return make_parser(serve).format_help()


def _entries(text: str) -> dict[str, str]:
    """flag -> its help entry (the lines from the flag to the next flag), whitespace collapsed."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+|[A-Z]+)\b", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def _flag_of(action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def test_no_placeholder_descriptions():
    text = _help_text()
    assert "engine argument" not in text
    for action in make_parser()._actions:
        assert action.help and action.help.strip(), action.dest


def test_every_flag_shows_its_default_exactly_once():
    entries = _entries(_help_text())
    parser = make_parser()
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        entry = entries[_flag_of(action)]
        assert entry.count("(default:") == 1, entry
        assert action.help.count("(default:") == 1, action.help
        assert action.help.count("default:") == 1, f"two defaults: {action.help}"


def test_no_none_where_the_resolved_default_is_known():
    resolved = _resolved_fields()
    assert {"cpu_kvcache_space", "max_num_batched_tokens", "enable_chunked_prefill",
            "preemption_mode"} <= resolved
    for action in make_parser()._actions:
        if action.dest in resolved:
            default = re.search(r"\(default: (.*)\)$", action.help).group(1)
            assert not default.startswith("None"), f"{_flag_of(action)}: {action.help}"


@pytest.mark.parametrize("flag, shown", [
    ("--enable-chunked-prefill", "(default: True)"), ("--preemption-mode", "(default: 'recompute')"),
    ("--max-num-batched-tokens", "512 on CPU, 2048 on CUDA"), ("--cpu-kvcache-space", "else 4)"),
    ("--max-model-len", "(default: from the model's config.json)"),
])
def test_resolved_defaults_shown(flag, shown):
    assert shown in _entries(_help_text())[flag]


def test_every_flag_has_a_group_and_flags_sit_in_their_groups():
    names = {f.name for f in dataclasses.fields(EngineArgs)} | set(COMPAT_ARGS)
    assert names - set(FLAG_GROUPS) == set()
    parser = make_parser(serve_command=True)
    titles = [g.title for g in parser._action_groups]
    for key, vllm_name, _ in GROUPS:
        assert f"{key} ({vllm_name})" in titles
    assert "other" not in titles
    by_title = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert {"max_num_batched_tokens", "scheduler_delay_factor"} <= by_title["scheduler (SchedulerConfig)"]
    assert {"enable_lora", "lora_modules"} <= by_title["lora (LoRAConfig)"]
    assert {"host", "port"} <= by_title["server (Frontend)"]
    grouped = [a for g in parser._action_groups for a in g._group_actions]
    assert len(grouped) == len(parser._actions)  # every flag shown once


def test_compat_flags_are_marked_refused_or_deprecated():
    entries = _entries(_help_text())
    for name, arg in COMPAT_ARGS.items():
        entry = entries["--" + name.replace("_", "-")]
        if arg.kind == "refused" and arg.reason:
            assert "refused:" in entry, entry
        elif arg.kind == "noop" or (arg.kind == "alias" and arg.reason):
            assert "deprecated" in entry, entry


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        make_parser(argv[:1] == ("serve",)).parse_args(list(argv[1:] if argv[:1] == ("serve",) else argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_help_group(capsys):
    code, out, _ = _run(capsys, "--help=scheduler")
    assert code == 0
    assert out.startswith("scheduler (SchedulerConfig):")
    assert "--max-num-batched-tokens" in out and "--port" not in out and "--model " not in out
    code, out2, _ = _run(capsys, "--help=SchedulerConfig")  # vLLM's group name
    assert (code, out2) == (0, out)
    code, out, _ = _run(capsys, "serve", "--help", "lora")
    assert code == 0 and "--max-lora-rank" in out and "refused:" in out


def test_help_listgroup(capsys):
    code, out, _ = _run(capsys, "--help=listgroup")
    assert code == 0
    for key, vllm_name, _ in GROUPS:
        assert re.search(rf"^  {key}\s+{vllm_name}\b", out, re.MULTILINE)


def test_help_keyword_and_unknown(capsys):
    code, out, _ = _run(capsys, "--help=prefix-caching")
    assert code == 0 and "--enable-prefix-caching" in out and "--port" not in out
    code, _, err = _run(capsys, "--help=nosuchthing")
    assert code == 2 and "no such group or flag" in err and "listgroup" in err


def test_full_help_is_grouped_and_readable(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert out.index("model (ModelConfig):") < out.index("scheduler (SchedulerConfig):") < \
        out.index("server (Frontend):")
    assert out.splitlines()[0].startswith("usage: aserve [flags]")
    assert len(out.splitlines()[0]) < 120  # a one-line usage, not every flag
