"""Attention backends: the protocol (`base.py`), the torch reference (CPU) and the Triton one (CUDA)."""


def make_attention_backend(name: str):
    """The attention backend `--attention-backend` names (resolved: "triton" or "torch")."""
    if name == "triton":
        from aserve.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from aserve.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
