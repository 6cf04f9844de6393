"""specdec: lossless speculative decoding for Hugging Face causal language models."""

from . import drafters
from .decode import GenerationConfig, GenerationOutput, generate
from .drafters.base import TreeConfig
from .errors import SpecdecError
from .sampling import SamplingConfig
from .stats import Stats
from .target import Target, load_target

__all__ = ["GenerationConfig", "GenerationOutput", "SamplingConfig", "SpecdecError", "Stats", "Target",
           "TreeConfig", "drafters", "generate", "load_target"]
__version__ = "0.1.0"
