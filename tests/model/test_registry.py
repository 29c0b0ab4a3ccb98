"""The architecture registry agrees with the torch-free name list the config validates against."""

import pytest

from aserve.config import SUPPORTED_ARCHITECTURES
from aserve.model.models.base import CausalLM
from aserve.model.models.registry import MODEL_CLASSES, get_model_class


def test_every_supported_name_has_a_class():
    assert set(MODEL_CLASSES) == SUPPORTED_ARCHITECTURES
    for name in SUPPORTED_ARCHITECTURES:
        assert issubclass(get_model_class(name), CausalLM)


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM"):
        get_model_class("FalconForCausalLM")
