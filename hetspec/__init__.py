"""hetspec: lossless speculative decoding between models with different vocabularies (SLEM, TLI, SLRS)."""

from hetspec.config import ModelConfig, SamplingParams, SpeculationConfig
from hetspec.engine import Engine
from hetspec.output import GenerationResult, Stats, StreamEvent
from hetspec.models import LanguageModel, load_model

__all__ = ["Engine", "GenerationResult", "LanguageModel", "ModelConfig", "SamplingParams", "SpeculationConfig",
           "Stats", "StreamEvent", "load_model"]
