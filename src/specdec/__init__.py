"""specdec: lossless speculative decoding for Hugging Face causal language models."""

from specdec import drafters
from specdec.engine import GenerationOutput, generate
from specdec.drafters.base import TreeConfig
from specdec.errors import SpecdecError
from specdec.sampling import SamplingConfig
from specdec.stats import Stats
from specdec.decode import GenerationConfig
from specdec.backends.target import Target, load_target

__all__ = ["GenerationConfig", "GenerationOutput", "SamplingConfig", "SpecdecError", "Stats", "Target",
           "TreeConfig", "drafters", "generate", "load_target"]
__version__ = "0.1.0"
