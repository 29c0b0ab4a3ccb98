"""`--load-format npcache` (vLLM's): a checkpoint's tensors cached as numpy files on the first load and
memory-mapped from them afterwards, so a PyTorch `.bin` checkpoint is unpickled once and later loads
(restarts, more tensor-parallel ranks) only map files.

The cache is `$ASERVE_CACHE_DIR/npcache/<key>/` (default `~/.cache/aserve`), the key a digest of the
folder's path and its weight files' names, sizes and modification times, so a changed checkpoint gets a
fresh cache. It is written into a temporary folder and renamed into place, so a reader never sees half a
cache and concurrent writers cannot corrupt one. bfloat16 tensors (which numpy lacks) are stored as
their 16-bit patterns and viewed back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import torch

from aserve.model_source import cache_root

_INDEX = "index.json"


def npcache_folder(model_path: str, files: list[str]) -> str:
    """The cache folder for these weight files of `model_path` (it may not exist yet)."""
    digest = hashlib.sha256(os.path.abspath(model_path).encode())
    for path in files:
        st = os.stat(path)
        digest.update(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return os.path.join(cache_root(), "npcache", digest.hexdigest()[:24])


def npcache_weights(model_path: str, ignore_patterns: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every checkpoint tensor, from the numpy cache (built first when missing)."""
    from aserve.model.loader import iterate_weights, weight_files

    _, files = weight_files(model_path, "auto", ignore_patterns)
    folder = npcache_folder(model_path, files)
    if not os.path.isfile(os.path.join(folder, _INDEX)):
        _write_cache(folder, iterate_weights(model_path, "auto", ignore_patterns=ignore_patterns))
    with open(os.path.join(folder, _INDEX)) as f:
        entries = json.load(f)
    for entry in entries:
        array = np.load(os.path.join(folder, entry["file"]), mmap_mode="c")  # copy-on-write: writable, lazy
        tensor = torch.from_numpy(array)
        if entry["dtype"] == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        yield entry["name"], tensor


def _write_cache(folder: str, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".writing-", dir=os.path.dirname(folder))
    try:
        entries = []
        for i, (name, tensor) in enumerate(weights):
            tensor = tensor.detach().contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            array = tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
            np.save(os.path.join(tmp, f"{i}.npy"), array)
            entries.append({"name": name, "file": f"{i}.npy", "dtype": dtype})
        with open(os.path.join(tmp, _INDEX), "w") as f:
            json.dump(entries, f)
        os.rename(tmp, folder)
    except OSError:
        if not os.path.isfile(os.path.join(folder, _INDEX)):  # not another writer's finished cache
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
