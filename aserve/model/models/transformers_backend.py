"""The Transformers backend (`--model-impl transformers`): transformers' own modeling code for any
decoder-only causal LM, with aserve's paged attention in place of its attention.

transformers routes each attention layer through `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
(`fn(module, query [B, H, S, D], key, value [B, KVH, S, D], attention_mask, scaling=, dropout=,
sliding_window=, softcap=, **kwargs) -> (out [B, S, H, D], None)`). aserve registers
`aserve_paged_attention` there under `ATTN_IMPLEMENTATION` and sets the model's implementation to it.
The engine's flat batch of T tokens runs as one sequence (`input_ids[None]`,
`position_ids=positions[None]`, no HF cache), and each call maps its HF attention module to the
aserve `Attention` layer holding that layer's KV cache (one per decoder layer, bound by
`CausalLM.bind_kv_caches`), then calls the attention backend with the step's `AttentionMetadata`
and the scaling, sliding window and soft-cap transformers passed. The metadata reaches the function
through `_STEP`, a context variable set by `forward` for that forward pass only: nothing per step
is threaded through transformers' signatures or outlives the step.

Which module is which layer, and each layer's heads, is learnt by `probe` at load: one forward over
a few tokens with dense causal attention, which also refuses what this path cannot serve faithfully
(attention not routed through the interface, a layer called twice, a custom mask, attention sinks,
position biases, non-causal attention, shapes that disagree with the KV cache the runner sizes from
`ArchConfig`, and logits the HF model computes other than `compute_logits` does).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from aserve.config import ArchConfig
from aserve.model.attention.base import AttentionBackend, AttentionMetadata
from aserve.model.layers.attention import Attention
from aserve.model.models.base import CausalLM

ATTN_IMPLEMENTATION = "aserve_paged"
# Keyword arguments of the attention call that change the result in ways aserve's backends do not
# implement: attention sinks (gpt-oss), relative position biases (T5-style), ALiBi, chunked attention.
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "alibi", "attention_chunk_size")


class UnsupportedModelError(ValueError):
    """The model's transformers implementation cannot be served faithfully by this backend."""


@dataclass(frozen=True)
class LayerCall:
    """What one attention call showed during the probe."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    softcap: float | None


@dataclass
class _Step:
    """One forward pass: the step's metadata (None during the load-time probe, which attends densely
    and records each layer's call in `calls`, keyed by the HF module's id)."""

    model: TransformersCausalLM
    meta: AttentionMetadata | None
    calls: dict[int, LayerCall] = field(default_factory=dict)


_STEP: ContextVar[_Step | None] = ContextVar("aserve_transformers_step", default=None)


@contextmanager
def _active(step: _Step) -> Iterator[_Step]:
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


def aserve_paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           sliding_window: int | None = None, softcap: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over aserve's paged attention (see the module
    docstring); RuntimeError outside an aserve forward."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION!r} attention runs only inside an aserve model's forward")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else None
    if step.meta is None:
        return step.model.probe_attention(step, module, query, key, value, attention_mask, scale, window, cap,
                                          kwargs)
    return step.model.paged_attention(module, query, key, value, step.meta, scale, window, cap)


AttentionInterface.register(ATTN_IMPLEMENTATION, aserve_paged_attention)


class TransformersCausalLM(CausalLM):
    """A transformers `*ForCausalLM` behind aserve's `CausalLM` interface: `forward(input_ids [T],
    positions [T], meta) -> hidden [T, hidden]` (the decoder's last hidden state), `compute_logits`
    (transformers' LM head plus the family's final logit scaling / soft-capping, float32).
    Call `probe()` once the weights are in, before `bind_kv_caches`."""

    def __init__(self, hf_model: nn.Module, arch: ArchConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__(arch, backend, dtype)
        self.hf = hf_model
        decoder = getattr(hf_model, hf_model.base_model_prefix, None)
        if not isinstance(decoder, nn.Module) or decoder is hf_model:
            raise UnsupportedModelError(f"{type(hf_model).__name__}: no decoder module to run "
                                        f"(base_model_prefix {hf_model.base_model_prefix!r})")
        self.attn = nn.ModuleList()  # one aserve Attention per decoder layer, built by probe()
        self._layer_of: dict[int, int] = {}  # id(HF attention module) -> index into self.attn
        cfg = hf_model.config
        self.final_logit_softcap = getattr(cfg, "final_logit_softcapping", None) or None  # Gemma 2 / 3
        self.logit_scale = getattr(cfg, "logit_scale", None)  # Cohere: logits * logit_scale
        self.logits_scaling = getattr(cfg, "logits_scaling", None)  # Granite: logits / logits_scaling

    @property
    def decoder(self) -> nn.Module:
        """transformers' decoder stack inside `self.hf` (its last hidden state is what forward returns)."""
        return getattr(self.hf, self.hf.base_model_prefix)

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not isinstance(meta, AttentionMetadata):
            raise TypeError(f"the Transformers backend runs eagerly on AttentionMetadata, got {type(meta).__name__}")
        if not self._layer_of:
            raise RuntimeError("call probe() before the first forward")
        begin_forward = getattr(self.backend, "begin_forward", None)
        if begin_forward is not None:  # optional hook: lets the backend plan once per step
            begin_forward(meta)
        with _active(_Step(self, meta)):
            out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden).float()
        if self.logit_scale is not None:
            logits = logits * float(self.logit_scale)
        if self.logits_scaling is not None:
            logits = logits / float(self.logits_scaling)
        if self.final_logit_softcap is not None:
            cap = float(self.final_logit_softcap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def paged_attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None,
                        softcap: float | None) -> tuple[torch.Tensor, None]:
        layer = self.attn[self._layer_of[id(module)]]
        if layer.kv_cache is None:
            raise RuntimeError("no KV cache bound: call bind_kv_caches before forward")
        # [1, heads, T, D] -> [T, heads, D]
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        out = self.backend.forward(q, k, v, layer.kv_cache, meta, scale, window, softcap, *layer.kv_scales(k, v, meta))
        return out[None], None

    # -- start-up -----------------------------------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        raise NotImplementedError("the Transformers backend loads through transformers (see transformers_loading.py)")

    @torch.inference_mode()
    def probe(self, num_tokens: int = 8) -> None:
        """Run the model once over `num_tokens` tokens with dense causal attention: learn each layer's
        module and heads, build the aserve `Attention` layers, and check that this path computes
        transformers' own logits. Raises UnsupportedModelError naming what it cannot serve."""
        device = next(self.hf.parameters()).device
        ids = (torch.arange(num_tokens, device=device) * 7 + 3) % self.arch.vocab_size
        positions = torch.arange(num_tokens, device=device)
        with _active(_Step(self, None)) as step:
            hidden = self.decoder(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        ours = self.compute_logits(hidden.last_hidden_state[0])
        self._check_calls(step.calls)
        if ours.shape[-1] != self.arch.vocab_size:
            raise UnsupportedModelError(f"{type(self.hf).__name__}: its LM head gives {ours.shape[-1]} logits, "
                                        f"config.json's vocab_size is {self.arch.vocab_size}")
        with _active(_Step(self, None)):
            expected = self.hf(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0].float()
        if ours.shape != expected.shape or not _close(ours, expected, self.dtype):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__}: its forward turns the decoder's hidden states into logits in a way this "
                "backend does not reproduce (LM head plus final_logit_softcapping / logit_scale / logits_scaling)")
        self.attn = nn.ModuleList(
            Attention(c.num_heads, c.head_dim, c.num_kv_heads, c.scale, self.backend, c.sliding_window, c.softcap)
            for c in step.calls.values())
        self._layer_of = {module_id: i for i, module_id in enumerate(step.calls)}

    def _check_calls(self, calls: dict[int, LayerCall]) -> None:
        a, name = self.arch, type(self.hf).__name__
        if len(calls) != a.num_hidden_layers:
            raise UnsupportedModelError(
                f"{name}: {len(calls)} of its {a.num_hidden_layers} layers attend through transformers' "
                "AttentionInterface; the rest compute attention their own way or are recurrent / state-space "
                "layers, which aserve's paged KV cache cannot serve")
        for i, c in enumerate(calls.values()):
            if (c.num_kv_heads, c.head_dim) != (a.num_key_value_heads, a.head_dim) or c.num_heads % c.num_kv_heads:
                raise UnsupportedModelError(
                    f"{name}: layer {i} attends with {c.num_heads} query / {c.num_kv_heads} KV heads of "
                    f"{c.head_dim} dims, but config.json gives {a.num_attention_heads} / {a.num_key_value_heads} "
                    f"heads of {a.head_dim} dims (the KV cache is sized from config.json)")

    def probe_attention(self, step: _Step, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float, window: int | None,
                        softcap: float | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
        """Dense causal attention for the probe; records the call and refuses what it cannot serve."""
        name = f"{type(self.hf).__name__} ({type(module).__name__})"
        used = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
        if used:
            raise UnsupportedModelError(f"{name}: its attention takes {used}, which aserve's paged attention "
                                        "does not implement")
        if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
            raise UnsupportedModelError(f"{name}: non-causal (bidirectional) attention is not served")
        if query.shape[0] != 1 or key.shape[2] != query.shape[2] or not (
                query.shape[-1] == key.shape[-1] == value.shape[-1]) or query.shape[1] % key.shape[1]:
            raise UnsupportedModelError(f"{name}: attention shapes q {list(query.shape)}, k {list(key.shape)}, "
                                        f"v {list(value.shape)} do not fit aserve's paged KV cache")
        if id(module) in step.calls:
            raise UnsupportedModelError(f"{name}: one attention module is called twice in a forward pass "
                                        "(shared layers cannot each own a KV cache)")
        allowed = _causal_allowed(query.shape[2], window, query.device)
        if attention_mask is not None and not _mask_is(attention_mask, allowed):
            raise UnsupportedModelError(f"{name}: the model builds its own attention mask (e.g. ALiBi or a "
                                        "non-causal pattern), which aserve's paged attention cannot apply")
        step.calls[id(module)] = LayerCall(query.shape[1], key.shape[1], query.shape[-1], scale, window, softcap)
        rep = query.shape[1] // key.shape[1]
        k = key.float().repeat_interleave(rep, dim=1)
        v = value.float().repeat_interleave(rep, dim=1)
        scores = query.float() @ k.transpose(-1, -2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
        return (probs @ v).to(query.dtype).transpose(1, 2), None


def _causal_allowed(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, n] bool: query i sees key j when j <= i (and i - window < j)."""
    i = torch.arange(n, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    return allowed


def _mask_is(mask: torch.Tensor, allowed: torch.Tensor) -> bool:
    """Whether a bool (True: attend) or additive float mask is exactly the causal pattern `allowed`."""
    tail = mask.reshape(-1, *mask.shape[-2:])
    if tail.shape[-2:] != allowed.shape:
        return False
    if mask.dtype == torch.bool:
        return bool((tail == allowed).all())
    finite_zero = tail == 0
    very_negative = tail <= torch.finfo(tail.dtype).min / 2
    return bool((finite_zero == allowed).all() and (very_negative == ~allowed).all())


def _close(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = float(expected.abs().max()) or 1.0
    return bool(((ours - expected).abs() <= tol * scale).all())
