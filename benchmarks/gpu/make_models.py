"""Random-weight model folders for the GPU benchmarks (config.json + the bundled tokenizer; served with
`--load-format dummy`): `1b` is Llama-3.2-1B's shape, `8b` Llama-3.1-8B's.

    python3 benchmarks/gpu/make_models.py /tmp/models [--tokenizer .gpu/tokenizer]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
          "eos_token_id": 2, "max_position_embeddings": 8192, "vocab_size": 128256}
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--tokenizer", default=".gpu/tokenizer")
    args = parser.parse_args()
    for name, shape in SHAPES.items():
        folder = Path(args.out) / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**COMMON, **shape}, indent=1))
        for f in Path(args.tokenizer).iterdir():
            shutil.copy(f, folder / f.name)
        print(folder)


if __name__ == "__main__":
    main()
