"""A tiny Llama *trained* (seconds on a CPU) on a first-order Markov language, for quantization tests.

A random-weight tiny model's next-token distributions are nearly flat, so any weight rounding flips its
argmax (plain bf16 reaches only ~97% top-1 there). This model learns a language where each token has
two successors (probabilities 3/4 and 1/4): its distributions are peaked as a real model's are, so
top-1 agreement after quantization measures the quantization, not the noise floor.

`markov_sequences(n, length, seed)` draws sentences of that language (token ids 3..399);
`save_trained_tiny_llama(folder)` saves the byte-level BPE tokenizer of `tests/server/real_tiny_server.py`
(ChatML template) and the trained model (hidden 128, intermediate 256, 2 layers, 4 heads / 2 KV heads,
vocabulary 512, fp32, untied LM head).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_IDS = (3, 400)  # the language's token ids: [3, 400)
_SUCCESSOR_SEED = 7


def markov_sequences(n: int, length: int, seed: int) -> torch.Tensor:
    """`[n, length]` token ids of the Markov language (the successor table is fixed; `seed` draws the walks)."""
    lo, hi = VOCAB_IDS
    successors = torch.randint(lo, hi, (hi, 2), generator=torch.Generator().manual_seed(_SUCCESSOR_SEED))
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n, length, dtype=torch.long)
    seqs[:, 0] = torch.randint(lo, hi, (n,), generator=gen)
    for t in range(1, length):
        pick = (torch.rand(n, generator=gen) > 0.75).long()
        seqs[:, t] = successors[seqs[:, t - 1], pick]
    return seqs


def save_trained_tiny_llama(folder: Path, steps: int = 120) -> str:
    """Train and save the model with its tokenizer into `folder`; returns it as a string."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from tests.server.real_tiny_server import build_tiny_chat_model

    build_tiny_chat_model(folder)  # the tokenizer (and a random model, replaced below)
    special = AutoConfig.from_pretrained(folder)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=special.bos_token_id, eos_token_id=special.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        batch = markov_sequences(32, 64, seed=1000 + step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(folder, safe_serialization=True)
    return str(folder)
