"""Tensor-parallel layer forms in a real 2-rank gloo group (two spawned processes): column, merged
column (q|k|v with replicated KV heads, gate|up; per-part and fused checkpoints), row with bias,
GPT-2's transposed forms, int8 on a column slice, vocab-parallel embedding and LM head (odd vocab,
tied), MoE experts; each against the same layer unsharded (tests/support/tp_layer_checks.py). And a
rank whose peer never arrives fails after the rendezvous timeout instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch.multiprocessing

from aserve.distributed.rendezvous import free_port
from tests.support import tp_layer_checks


@pytest.mark.timeout(120)
def test_sharded_layers_match_the_unsharded_layer():
    torch.multiprocessing.spawn(tp_layer_checks.run_rank, args=(2, free_port()), nprocs=2, join=True)


@pytest.mark.timeout(60)
def test_a_rank_whose_peer_never_comes_fails_after_the_timeout():
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=tp_layer_checks.join_alone, args=(free_port(), 1.0))
    start = time.monotonic()
    proc.start()
    proc.join(timeout=45)
    assert not proc.is_alive(), "the rendezvous must time out, not hang"
    assert proc.exitcode != 0
    assert time.monotonic() - start < 30
