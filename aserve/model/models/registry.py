"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from aserve.config import SUPPORTED_ARCHITECTURES
from aserve.config.hf_config import ENCODER_ARCHITECTURES
from aserve.model.models.bert import BertForSequenceClassification, BertModel
from aserve.model.models.decoder_embedder import decoder_embedder_class
from aserve.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from aserve.model.models.gpt2 import GPT2LMHeadModel
from aserve.model.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from aserve.model.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from aserve.model.models.opt import OPTForCausalLM
from aserve.model.models.phi3 import Phi3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
if set(MODEL_CLASSES) != SUPPORTED_ARCHITECTURES:  # the torch-free name list must match the classes
    raise RuntimeError(f"model registry {sorted(MODEL_CLASSES)} != aserve.config.SUPPORTED_ARCHITECTURES "
                       f"{sorted(SUPPORTED_ARCHITECTURES)}")


def get_model_class(architecture: str) -> type[nn.Module]:
    """Raises ValueError naming the supported architectures when `architecture` is unknown."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {sorted(MODEL_CLASSES)}") from None


# Encoder-only pooling models (issue 23), apart from the generating ones above.
POOLING_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
}
if set(POOLING_MODEL_CLASSES) != ENCODER_ARCHITECTURES:
    raise RuntimeError(f"pooling registry {sorted(POOLING_MODEL_CLASSES)} != aserve.config.hf_config."
                       f"ENCODER_ARCHITECTURES {sorted(ENCODER_ARCHITECTURES)}")


def get_pooling_model_class(architecture: str) -> type[nn.Module]:
    """The class serving `architecture` for pooling (embed / score / classify): an encoder's own
    (`POOLING_MODEL_CLASSES`), or a causal family's decoder embedder (no LM head; hidden states for
    LAST pooling). Raises ValueError naming the supported architectures when there is none."""
    if architecture in POOLING_MODEL_CLASSES:
        return POOLING_MODEL_CLASSES[architecture]
    if architecture in MODEL_CLASSES:
        return decoder_embedder_class(MODEL_CLASSES[architecture])
    raise ValueError(f"architecture {architecture!r} cannot serve pooling; supported: "
                     f"{sorted(POOLING_MODEL_CLASSES.keys() | MODEL_CLASSES.keys())}")
