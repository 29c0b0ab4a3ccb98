"""Convert a GGUF checkpoint into a plain Hugging Face folder: dequantized float32 safetensors,
config.json, tokenizer files (with the chat template) and generation_config.json.

Run it as a subprocess so server processes never import torch or transformers:

    python -m aserve.model.gguf_convert SRC.gguf DST_DIR

DST_DIR is created if missing; callers make the result atomic (write to a temp dir, then rename).
Exit status 0 on success; on failure a message on stderr and status 1.
"""

from __future__ import annotations

import json
import os
import sys

# Keys of a GGUF-loaded config that describe the GGUF file, not the converted checkpoint.
_DROPPED_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


def convert_gguf(src: str, dst: str) -> None:
    """Dequantize `src` (a .gguf file) into the Hugging Face folder `dst`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(src))
    os.makedirs(dst, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {}
    for key, tensor in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        state[key] = tensor.detach().to(torch.float32).contiguous()
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    for key in _DROPPED_CONFIG_KEYS:
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = config["torch_dtype"] = "float32"
    config.pop("id2label", None)
    config.pop("label2id", None)
    _write_json(os.path.join(dst, "config.json"), config)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.model_max_length = int(config.get("max_position_embeddings") or tokenizer.model_max_length)
    # The special tokens named by the GGUF metadata's ids (config.json has them right; some transformers
    # releases name the wrong token in the converted tokenizer, e.g. <|im_start|> as eos).
    for kind in ("bos", "eos"):
        token_id = config.get(f"{kind}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{kind}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.save_pretrained(dst)
    _tidy_tokenizer_config(dst, tokenizer.chat_template)

    gen = {k: v for k, v in (("bos_token_id", config.get("bos_token_id")),
                             ("eos_token_id", config.get("eos_token_id")),
                             ("pad_token_id", config.get("pad_token_id"))) if v is not None}
    if gen:
        _write_json(os.path.join(dst, "generation_config.json"), gen)
    _make_readable(dst)


def _tidy_tokenizer_config(dst: str, template: str | None) -> None:
    """Keep the chat template in tokenizer_config.json too (for readers that ignore chat_template.jinja)
    and drop the loading flags transformers records about the GGUF source."""
    path = os.path.join(dst, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(key, None)
    if template:
        cfg["chat_template"] = template
    _write_json(path, cfg)


def _make_readable(dst: str) -> None:
    for entry in os.listdir(dst):
        os.chmod(os.path.join(dst, entry), 0o644)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m aserve.model.gguf_convert SRC.gguf DST_DIR", file=sys.stderr)
        return 2
    src, dst = args
    if not os.path.isfile(src):
        print(f"gguf_convert: no such file: {src}", file=sys.stderr)
        return 1
    try:
        convert_gguf(src, dst)
    except Exception as e:  # noqa: BLE001 (reported to the parent process, which raises a clear error)
        print(f"gguf_convert: failed to convert {src}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
