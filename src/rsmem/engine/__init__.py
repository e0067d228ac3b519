"""Generation engine: request scheduling and token sampling on top of a :class:`~rsmem.context.Context`."""

from rsmem.engine.sampling import Sampler, SamplerOutput, SamplingParams, TokenLogprobs, make_generator

__all__ = ["Sampler", "SamplerOutput", "SamplingParams", "TokenLogprobs", "make_generator"]
