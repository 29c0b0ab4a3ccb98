"""A real server (hypercorn + the real AsyncEngine) on a tiny random-weight Llama with a small trained
BPE tokenizer, for tests that must exercise the whole intake -> engine -> runner path in seconds.

The model's vocabulary (`TINY_VOCAB`) is larger than the tokenizer's, as with padded vocabularies,
so that caps measured in token ids (logit_bias entries, stop_token_ids) can be tested at the cap.
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

TINY_VOCAB = 1536
TINY_MAX_MODEL_LEN = 128
_CORPUS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
    "hello world how are you today my friend the weather is nice and the sun is bright",
    "system user assistant tool message content role answer question",
    "one two three four five six seven eight nine ten eleven twelve",
]


def build_tiny_served_model(path: Path) -> str:
    """Saves a tiny Llama (vocab TINY_VOCAB) and a byte-level BPE tokenizer with ChatML special tokens
    (so the bundled ChatML template applies) to `path`; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.model._tiny_models import save_tiny_hf

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(path))
    save_tiny_hf(path, "llama", vocab_size=TINY_VOCAB, max_position_embeddings=256, eos_token_id=0)
    return str(path)


@contextlib.contextmanager
def running_tiny_server(model_path: str, **engine_args: Any) -> Iterator[tuple[Any, BoundAddress]]:
    """The real engine on `model_path` (fp32, max_model_len TINY_MAX_MODEL_LEN) behind the real server on
    127.0.0.1 (a free port), in a portal thread; yields (engine, address) and stops gracefully."""
    from aserve.engine.async_engine import AsyncEngine

    args = EngineArgs(model=model_path, dtype="float32", max_model_len=TINY_MAX_MODEL_LEN, cpu_kvcache_space=0.05,
                      **engine_args)
    server_args = ServerArgs(disable_log_requests=True, disable_log_stats=True, shutdown_grace_period=5.0,
                             host="127.0.0.1", port=0)
    with anyio.from_thread.start_blocking_portal("asyncio", backend_options={"use_uvloop": True}) as portal:
        engine = portal.call(AsyncEngine.from_engine_args, args)  # on the loop thread: it makes anyio primitives
        stop = portal.call(anyio.Event)
        future, address = portal.start_task(partial(serve, engine, server_args, stop=stop, handle_signals=False))
        try:
            yield engine, address
        finally:
            portal.call(stop.set)
            future.result(timeout=60)
