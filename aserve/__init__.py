"""aserve: an async-first, vLLM-class LLM inference server.

Public API: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`, `Logprob`, `EngineArgs`,
`GuidedDecodingParams` (alias `StructuredOutputsParams`), `LoRARequest`.
"""

from aserve.config import EngineArgs
from aserve.lora.request import LoRARequest
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams
from aserve.structured_outputs.params import GuidedDecodingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs",
           "RequestOutputKind", "GuidedDecodingParams", "StructuredOutputsParams", "LoRARequest", "__version__"]


def __getattr__(name: str):
    # LLM pulls in the engine and tokenizer stack; import it only when asked for.
    if name == "LLM":
        from aserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'aserve' has no attribute {name!r}")
