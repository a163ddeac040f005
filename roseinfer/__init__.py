"""roseinfer: an LLM inference engine built stage by stage, for reading."""

from roseinfer.engine import InferenceEngine
from roseinfer.llm import LLM
from roseinfer.llm_engine import LLMEngine
from roseinfer.loader import DEFAULT_MODEL
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams

__all__ = ["DEFAULT_MODEL", "LLM", "LLMEngine", "InferenceEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
