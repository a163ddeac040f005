"""roseinfer: an LLM inference engine built stage by stage, for reading."""

from roseinfer.config import EngineArgs
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.entrypoints.llm import LLM
from roseinfer.model_executor.loader import DEFAULT_MODEL
from roseinfer.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from roseinfer.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "DEFAULT_MODEL", "LLM", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput", "SamplingParams",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "RequestOutputKind", "Logprob",
    "StructuredOutputsParams",
]  # fmt: skip
__version__ = "0.1.0"
