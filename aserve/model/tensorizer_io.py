"""`--load-format tensorizer` (vLLM's): a checkpoint's tensors in one CoreWeave tensorizer `.tensors` file,
streamed into the model at load (`pip install 'aserve[tensorizer]'`).

Write one from a model folder (the tensors keep their Hugging Face names, so aserve's loader applies
quantization, LoRA and tensor-parallel sharding to them exactly as to safetensors):

    python -m aserve.model.tensorizer_io --model MODEL --output /path/model.tensors

then serve with the folder for config.json and the tokenizer, and the file for the weights:

    aserve --model MODEL --load-format tensorizer \
        --model-loader-extra-config '{"tensorizer_uri": "/path/model.tensors"}'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch

from aserve.config.loading import LoaderOptions

MISSING_LIBRARY = ("--load-format tensorizer needs the tensorizer package: pip install 'aserve[tensorizer]' "
                   "(or pip install tensorizer)")


def _tensorizer():
    try:
        import tensorizer
    except ImportError as exc:
        raise ValueError(MISSING_LIBRARY) from exc
    return tensorizer


def serialize_checkpoint(model_path: str, uri: str, ignore_patterns: tuple[str, ...] = ()) -> int:
    """Write every tensor of the folder's weight files (as `iterate_weights` reads them) to `uri`;
    returns how many."""
    from aserve.model.loader import iterate_weights

    state = dict(iterate_weights(model_path, "auto", ignore_patterns=ignore_patterns))
    serializer = _tensorizer().TensorSerializer(uri)
    try:
        serializer.write_state_dict(state)
    finally:
        serializer.close()
    return len(state)


def tensorizer_weights(options: LoaderOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of `options.tensorizer_uri`, read lazily (one at a time)."""
    deserializer = _tensorizer().TensorDeserializer(options.tensorizer_uri, device="cpu", lazy_load=True,
                                                    num_readers=options.tensorizer_num_readers,
                                                    verify_hash=options.tensorizer_verify_hash)
    try:
        for name in list(deserializer.keys()):
            yield name, deserializer[name]
    finally:
        deserializer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aserve.model.tensorizer_io",
                                description="Serialize a model folder's weights into a tensorizer file.")
    p.add_argument("--model", required=True, help="a folder, a .gguf file or the bundled model's name (as --model)")
    p.add_argument("--output", required=True, help="the .tensors file to write")
    args = p.parse_args(argv)
    from aserve.model_source import resolve_model

    try:
        count = serialize_checkpoint(resolve_model(args.model), args.output)
    except ValueError as exc:  # ModelSourceError, a missing package
        p.error(str(exc))
    print(f"wrote {count} tensors to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
