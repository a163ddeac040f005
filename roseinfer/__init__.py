"""roseinfer: an LLM inference engine built stage by stage, for reading."""

from roseinfer.engine import InferenceEngine
from roseinfer.loader import DEFAULT_MODEL
from roseinfer.sampling import SamplingParams

__all__ = ["DEFAULT_MODEL", "InferenceEngine", "SamplingParams"]
__version__ = "0.1.0"
