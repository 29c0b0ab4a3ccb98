import pytest


@pytest.fixture(scope="session")
def trained_llama(trained_tiny_llama) -> str:
    """The tiny Llama trained on the Markov language, with a tokenizer (tests/support/trained_tiny.py)."""
    return trained_tiny_llama
