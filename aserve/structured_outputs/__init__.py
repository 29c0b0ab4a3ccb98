"""Grammar-constrained decoding (structured outputs).

Two layers with different import weights:

- `params` (stdlib + msgspec only, safe for `sampling_params`, the engine and the server):
  `GuidedDecodingParams` / `StructuredOutputsParams`, its validation, its cache key, and
  `check_backend_name` for the `--guided-decoding-backend` engine argument.
- `registry` (`StructuredOutputCompilers`, `check_spec`, `resolve_backend`): picks a backend per
  spec and builds its compiler lazily; light to import, the backends load on first use.
- `backend` + `state` (xgrammar), `guidance` (llguidance), `cache` (the spec LRU), `bitmask`
  (batched fill/apply): runner side only, since `import xgrammar` imports torch.

This `__init__` re-exports only the light layer, so importing the package never pulls torch.
"""

from aserve.structured_outputs.params import (
    GUIDED_DECODING_BACKENDS,
    GrammarCompileError,
    GuidedDecodingParams,
    StructuredOutputsParams,
    check_backend_name,
)

__all__ = [
    "GUIDED_DECODING_BACKENDS",
    "GrammarCompileError",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "check_backend_name",
]
