"""Pipeline-parallel stages of a decoder (`--pipeline-parallel-size`), applied from outside the family
files; the hand-off between ranks is the runner's (`runner/pipeline_stage.py`).

A stage's model is built from `config.parallel.stage_arch_config`: only its layers exist, each built
with its global index (per-layer options such as sliding windows stay right), and the loader maps
checkpoint layer g to the stage's local layer g - first_layer, skipping the others
(`stage_local_name`). The stages exchange one tensor, the residual stream: a stage that is not the
last ends with `StreamOut` in place of the final norm (it returns hidden + residual, the value the
next layer's fused add-and-norm would form), and a stage that is not the first takes that tensor as
its embedding output (`PipelineInput`, a forward hook fed before each forward), which its first layer
treats as a fresh residual stream, so the composition computes exactly what the whole model does.
Families built on `LlamaModel` (Llama, Mistral, Qwen2/3, Phi-3, the MoE families) and Gemma 2/3 have
this shape (`config.parallel.PIPELINE_ARCHITECTURES`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from aserve.config import ArchConfig

_LAYER_NAME = re.compile(r"^((?:.*?\.)?(?:layers|h|layer)\.)(\d+)(\..*)$")


def stage_local_name(name: str, arch: ArchConfig) -> str | None:
    """A checkpoint tensor's name in a stage's model (`arch` a stage's view): a layer's tensor renamed
    to the stage's local index, or None when the layer belongs to another stage; others unchanged."""
    match = _LAYER_NAME.match(name)
    if match is None:
        return name
    local = int(match.group(2)) - arch.first_layer
    if not 0 <= local < arch.num_hidden_layers:
        return None
    return f"{match.group(1)}{local}{match.group(3)}"


class StreamOut(nn.Module):
    """In place of a non-last stage's final norm: `(hidden + residual, None)`, the residual stream."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return (hidden if residual is None else hidden + residual), None


class PipelineInput:
    """A forward hook on a non-first stage's embedding: its output is replaced by the stream the
    previous stage sent (`set_stream` before the forward)."""

    def __init__(self) -> None:
        self.stream: torch.Tensor | None = None

    def set_stream(self, stream: torch.Tensor) -> None:
        self.stream = stream

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            raise RuntimeError("a later pipeline stage ran without the previous stage's stream")
        stream, self.stream = self.stream, None
        return stream


def make_stage(model: nn.Module, is_first: bool, is_last: bool) -> PipelineInput | None:
    """Turns a loaded `LlamaModel`-shaped causal LM (`model.model.embed_tokens`, `.layers`, `.norm`) built from a
    stage's arch into that stage: the final norm becomes `StreamOut` unless `is_last`; unless `is_first`
    the embedding's output comes from the returned `PipelineInput`. ValueError for other shapes."""
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise ValueError(f"{type(model).__name__} has no Llama-shaped decoder: pipeline stages are not built for it")
    if not is_last:
        inner.norm = StreamOut()
    if is_first:
        return None
    if hasattr(inner, "embed_scale"):  # Gemma scales its embedding output: the stream arrives scaled
        inner.embed_scale = 1.0
    hook = PipelineInput()
    inner.embed_tokens.register_forward_hook(hook)
    return hook
