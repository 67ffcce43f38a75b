"""forerun: speculative decoding with exactly the target's output, only faster."""

from forerun.api import LLM, GenerationResult
from forerun.base.config import SamplingParams, StructuredOutputsParams
from forerun.base.errors import ForerunError

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GenerationResult", "ForerunError"]
__version__ = "0.1.0"
