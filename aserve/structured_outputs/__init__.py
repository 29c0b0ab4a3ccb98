"""Grammar-constrained decoding (structured outputs).

Two layers with different import weights:

- `params` (stdlib + msgspec only, safe for `sampling_params`, the engine and the server):
  `GuidedDecodingParams` / `StructuredOutputsParams`, its validation, its cache key, and
  `check_backend_name` for the `--guided-decoding-backend` engine argument.
- `backend`, `state`, `bitmask` (import xgrammar, which imports torch: runner side only):
  the cached grammar compiler, the per-request matcher state and the batched bitmask fill/apply.

This `__init__` re-exports only the light layer, so importing the package never pulls torch.
"""

from aserve.structured_outputs.params import (
    GUIDED_DECODING_BACKENDS,
    GuidedDecodingParams,
    StructuredOutputsParams,
    check_backend_name,
)

__all__ = [
    "GUIDED_DECODING_BACKENDS",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "check_backend_name",
]
