"""A real server (real AsyncEngine, real runner) on a tiny random-weight Llama with a real tokenizer.

`build_tiny_chat_model(folder)` saves a byte-level BPE tokenizer (ChatML template, ~400 tokens) and a
2-layer random Llama whose vocabulary (512) is larger than the tokenizer's, as many real checkpoints'
are. `serving(model, server_args, **engine_kwargs)` runs `aserve.server.launch.serve` in a blocking
portal's event-loop thread and yields `(engine, address)`; it stops gracefully on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread

from aserve.config import EngineArgs
from aserve.server.args import ServerArgs
from aserve.server.launch import BoundAddress, serve

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you!",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def f(x):\n    return x * 2  # numbers 0 1 2 3 4 5 6 7 8 9",
    "Emoji and accents: café, naïve, 東京, 🙂.",
]


TINY_MAX_MODEL_LEN = 128  # what `serving` uses unless told otherwise


def build_tiny_chat_model(folder: Path, vocab_size: int = 512) -> str:
    """Save the tokenizer and the random-weight model (vocabulary `vocab_size`, larger than the
    tokenizer's, as padded vocabularies are) into `folder`; returns it as a string."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _build_engine(model: str, engine_kwargs: dict[str, Any]) -> Any:
    from aserve.engine.async_engine import AsyncEngine

    # A thread executor keeps these servers quick to start; the server's default (mp) has its own tests.
    defaults = dict(max_model_len=TINY_MAX_MODEL_LEN, dtype="float32", max_num_seqs=16, num_gpu_blocks_override=64,
                    distributed_executor_backend="uni")
    return AsyncEngine.from_engine_args(EngineArgs(model=model, **{**defaults, **engine_kwargs}))


@contextlib.contextmanager
def serving(model: str, server_args: ServerArgs, **engine_kwargs: Any) -> Iterator[tuple[Any, BoundAddress]]:
    """Serve `model` on 127.0.0.1 (a free port); yields (engine, bound address)."""
    args = ServerArgs(**{**vars(server_args), "host": "127.0.0.1", "port": 0})
    with anyio.from_thread.start_blocking_portal("asyncio", backend_options={"use_uvloop": True}) as portal:
        engine = portal.call(_build_engine, model, engine_kwargs)  # on the loop: it makes anyio primitives
        stop = portal.call(anyio.Event)
        future, address = portal.start_task(partial(serve, engine, args, stop=stop, handle_signals=False))
        try:
            yield engine, address
        finally:
            portal.call(stop.set)
            future.result(timeout=60)
