"""The architecture registry agrees with the torch-free name list the config validates against."""

import pytest

from aserve.model.models.llama import LlamaForCausalLM
from aserve.model.models.registry import MODEL_CLASSES, get_model_class
from aserve.config import SUPPORTED_ARCHITECTURES


def test_every_supported_name_has_a_class():
    assert set(MODEL_CLASSES) == SUPPORTED_ARCHITECTURES
    for name in SUPPORTED_ARCHITECTURES:
        assert issubclass(get_model_class(name), LlamaForCausalLM)


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
