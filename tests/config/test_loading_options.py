"""`--model-loader-extra-config` and `--max-parallel-loading-workers` (aserve/config/loading.py): each load
format's keys, every refusal naming the flag, and the options reaching the typed config."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.loading import DEFAULT_NUM_THREADS, LoaderOptions, resolve_loader_options
from aserve.server.args import parse_args


def test_defaults_and_multithread_keys():
    assert resolve_loader_options(None, "auto", None) == LoaderOptions()
    opts = resolve_loader_options('{"enable_multithread_load": true, "num_threads": 3}', "safetensors", 2)
    assert (opts.multithread_load, opts.num_threads, opts.max_parallel_loading_workers) == (True, 3, 2)
    assert resolve_loader_options({"enable_multithread_load": True}, "pt", None).num_threads == DEFAULT_NUM_THREADS


def test_tensorizer_keys(tmp_path):
    path = tmp_path / "m.tensors"
    path.write_bytes(b"x")
    opts = resolve_loader_options({"tensorizer_uri": str(path), "num_readers": 2, "verify_hash": True}, "tensorizer",
                                  None)
    assert (opts.tensorizer_uri, opts.tensorizer_num_readers, opts.tensorizer_verify_hash) == (str(path), 2, True)


@pytest.mark.parametrize("extra, load_format, needle", [
    ({"foo": 1}, "auto", "unknown key(s) ['foo'] for --load-format auto; known: ['enable_multithread_load'"),
    ({"num_threads": 0}, "auto", "'num_threads' must be >= 1"),
    ({"num_threads": "4"}, "auto", "'num_threads' must be int"),
    ({"enable_multithread_load": 1}, "auto", "'enable_multithread_load' must be bool"),
    ({"enable_multithread_load": True}, "dummy", "unknown key(s) ['enable_multithread_load'] for --load-format dummy"),
    ({"tensorizer_uri": "x"}, "auto", "unknown key(s) ['tensorizer_uri'] for --load-format auto"),
    ({}, "tensorizer", "--load-format tensorizer needs {\"tensorizer_uri\""),
    ({"tensorizer_uri": "/no/such.tensors"}, "tensorizer", "no such file"),
    ({"tensorizer_uri": "x", "encryption_keyfile": "k"}, "tensorizer", "'encryption_keyfile': encrypted tensorizer"),
    ({"tensorizer_uri": "s3://b/m.tensors", "s3_endpoint": "e"}, "tensorizer", "S3 sources are not implemented"),
    ("{oops", "auto", "not valid JSON"),
    ("[1, 2]", "auto", "must be a JSON object"),
])
def test_refusals_name_the_flag(extra, load_format, needle):
    with pytest.raises(ConfigError, match="^--model-loader-extra-config") as info:
        EngineArgs(model="", load_format=load_format, model_loader_extra_config=extra).validate()
    assert needle in str(info.value)


@pytest.mark.parametrize("workers", [0, -1, True, 1.5])
def test_max_parallel_loading_workers_must_be_a_positive_int(workers):
    with pytest.raises(ConfigError, match="^--max-parallel-loading-workers: "):
        EngineArgs(model="", max_parallel_loading_workers=workers).validate()


def test_cli_flags_reach_the_typed_config(tiny_llama):
    engine_args, _ = parse_args(["--model", tiny_llama, "--model-loader-extra-config",
                                 '{"enable_multithread_load": true, "num_threads": 2}',
                                 "--max-parallel-loading-workers", "1"])
    options = engine_args.create_config().load.options
    assert options == LoaderOptions(multithread_load=True, num_threads=2, max_parallel_loading_workers=1)


def test_tensorizer_refuses_a_quantized_checkpoint(tmp_path):
    import json

    from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

    save_tiny_hf(tmp_path, "llama", seed=0, **GREEDY_STABLE)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    uri = tmp_path / "m.tensors"
    uri.write_bytes(b"x")
    with pytest.raises(ConfigError, match="^--load-format: 'tensorizer' reads float checkpoints"):
        EngineArgs(model=str(tmp_path), load_format="tensorizer",
                   model_loader_extra_config={"tensorizer_uri": str(uri)}).create_config()
