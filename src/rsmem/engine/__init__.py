"""Generation: requests, sampling, continuous batching, and the high-level ``LLM`` API."""

from rsmem.engine.engine import Engine
from rsmem.engine.llm import LLM, default_model_path, load_text_model
from rsmem.engine.request import CompletionOutput, FinishReason, RequestOutput, Session
from rsmem.engine.sampling import Sampler, SamplerOutput, SamplingParams, TokenLogprobs, make_generator
from rsmem.engine.status import EngineStats
from rsmem.engine.tokenizer import IncrementalDetokenizer, TextTokenizer

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineStats",
    "FinishReason",
    "IncrementalDetokenizer",
    "RequestOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "Session",
    "TextTokenizer",
    "TokenLogprobs",
    "default_model_path",
    "load_text_model",
    "make_generator",
]
