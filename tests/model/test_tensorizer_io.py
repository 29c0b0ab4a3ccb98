"""`--load-format tensorizer` (a checkpoint serialized with `python -m aserve.model.tensorizer_io`) and
`--model-loader-extra-config '{"enable_multithread_load": true}'` (files read on threads): both load the
same tensors as plain safetensors, so the served greedy tokens are identical; a corrupted file is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.model.loader import iterate_weights
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

pytest.importorskip("tensorizer")

PROMPTS = [[5, 17, 33, 9, 100, 200, 7], [3, 4, 5, 6], [250, 12, 99, 1, 42, 42, 42, 8, 9]]


def _greedy(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", max_model_len=128, num_gpu_blocks_override=32, skip_tokenizer_init=True,
              **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    """A tiny Llama saved in several safetensors shards (an index file names them)."""
    path = tmp_path_factory.mktemp("sharded")
    model = save_tiny_hf(path, "llama", seed=5, **GREEDY_STABLE)
    for f in path.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(path, max_shard_size="200KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    return str(path)


def test_tensorizer_round_trip_serves_the_same_tokens(sharded, tmp_path):
    from aserve.model.tensorizer_io import main as tensorize

    uri = tmp_path / "model.tensors"
    assert tensorize(["--model", sharded, "--output", str(uri)]) == 0
    want = dict(iterate_weights(sharded, "auto"))
    from aserve.config.loading import LoaderOptions
    from aserve.model.tensorizer_io import tensorizer_weights

    got = dict(tensorizer_weights(LoaderOptions(tensorizer_uri=str(uri), tensorizer_verify_hash=True)))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    config_only = tmp_path / "config_only"  # the folder gives config.json / tokenizer; the weights come from uri
    shutil.copytree(sharded, config_only, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    assert _greedy(str(config_only), load_format="tensorizer",
                   model_loader_extra_config={"tensorizer_uri": str(uri), "num_readers": 2}) == _greedy(sharded)


def test_tensorizer_corrupted_file_fails_the_load(sharded, tmp_path):
    from aserve.model.tensorizer_io import serialize_checkpoint

    uri = tmp_path / "model.tensors"
    serialize_checkpoint(sharded, str(uri))
    data = bytearray(uri.read_bytes())
    data[len(data) // 2] ^= 0xFF
    uri.write_bytes(bytes(data))
    with pytest.raises(Exception, match="(?i)hash|crc32|checksum|corrupt"):
        _greedy(sharded, load_format="tensorizer",
                model_loader_extra_config={"tensorizer_uri": str(uri), "verify_hash": True})


def test_multithread_load_reads_every_shard_in_order(sharded, monkeypatch):
    from aserve.model import loader

    threads: set[str] = set()
    real = loader._read_file

    def spy(kind, path, skip):
        import threading

        threads.add(threading.current_thread().name)
        return real(kind, path, skip)

    monkeypatch.setattr(loader, "_read_file", spy)
    single = list(iterate_weights(sharded, "auto"))
    threaded = list(iterate_weights(sharded, "auto", num_threads=3))
    assert [n for n, _ in threaded] == [n for n, _ in single]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(threaded, single, strict=True))
    assert threads and all(t.startswith("aserve-load") for t in threads)
    assert _greedy(sharded, model_loader_extra_config={"enable_multithread_load": True, "num_threads": 2}) == \
        _greedy(sharded)


def test_tensorizer_cli_names_a_missing_model(tmp_path, capsys):
    from aserve.model.tensorizer_io import main as tensorize

    with pytest.raises(SystemExit):
        tensorize(["--model", str(Path(tmp_path) / "nope"), "--output", str(tmp_path / "x.tensors")])
    assert "no such file or folder" in capsys.readouterr().err
