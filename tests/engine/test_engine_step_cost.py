"""What an engine step does not do: copy the step's logits, or look at every request it holds."""

from __future__ import annotations

import torch

from rsmem import Context
from rsmem.engine import Engine, FinishReason, SamplingParams
from rsmem.models import DecayedSumModel


def make_engine(n_seq_max: int = 4) -> Engine:
    model = DecayedSumModel(n_vocab=64, n_embd=6, n_layer=2, seed=3)
    return Engine(Context(model, n_seq_max=n_seq_max, n_batch=64, n_ubatch=16), max_batch_tokens=32)


def test_a_decode_step_samples_the_contexts_logits_without_a_copy():
    engine = make_engine()
    for k in range(3):
        engine.add_request([1 + k, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    engine.step()  # the prompts
    seen: list[torch.Tensor] = []
    sample = engine.output.sampler.sample

    def spy(logits, *args, **kwargs):
        seen.append(logits)
        return sample(logits, *args, **kwargs)

    engine.output.sampler.sample = spy  # type: ignore[method-assign]
    engine.step()
    assert len(seen) == 1 and seen[0] is engine.ctx.logits


def test_finished_requests_are_reported_once_and_forgotten():
    engine = make_engine(n_seq_max=1)
    running = engine.add_request([1, 2], SamplingParams(max_tokens=3, temperature=0.0))
    waiting = [engine.add_request([3, k], SamplingParams(max_tokens=3)) for k in range(5)]
    engine.step()
    assert engine.abort(waiting[2])
    reports = {r.request_id: r for r in engine.step()}
    assert reports[waiting[2]].finished
    assert reports[waiting[2]].outputs[0].finish_reason is FinishReason.ABORT
    assert waiting[2] not in engine.requests
    finals = [r.request_id for r in engine.run_until_done() if r.finished]
    assert sorted(finals) == sorted([running, *waiting[:2], *waiting[3:]])  # each once, the aborted not again
    assert not engine.requests and not engine.has_unfinished
