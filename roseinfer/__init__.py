"""roseinfer: an LLM inference engine built stage by stage, for reading."""

from roseinfer.engine import InferenceEngine
from roseinfer.llm import LLM
from roseinfer.llm_engine import LLMEngine
from roseinfer.loader import DEFAULT_MODEL
from roseinfer.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from roseinfer.sampling import BeamSearchParams, SamplingParams

__all__ = [
    "DEFAULT_MODEL", "LLM", "LLMEngine", "InferenceEngine", "RequestOutput", "CompletionOutput", "SamplingParams",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
]  # fmt: skip
__version__ = "0.1.0"
