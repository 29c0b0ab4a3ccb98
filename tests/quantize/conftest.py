import pytest

from tests.support.trained_tiny import save_trained_tiny_llama


@pytest.fixture(scope="session")
def trained_llama(tmp_path_factory) -> str:
    """The tiny Llama trained on the Markov language, with a tokenizer (tests/support/trained_tiny.py)."""
    return save_trained_tiny_llama(tmp_path_factory.mktemp("trained_llama"))
