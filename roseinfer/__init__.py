"""roseinfer: an LLM inference engine built stage by stage, for reading."""

from roseinfer.engine import InferenceEngine
from roseinfer.llm import LLM
from roseinfer.loader import DEFAULT_MODEL
from roseinfer.outputs import RequestOutput
from roseinfer.sampling import SamplingParams

__all__ = ["DEFAULT_MODEL", "LLM", "InferenceEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
