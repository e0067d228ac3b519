"""The C++ sampler (csrc/sampler.cpp) against its torch twin (rsmem.engine.sampling with native=False)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from rsmem.engine import LLM, SamplingParams
from rsmem.engine.sampling import Sampler, apply_penalties, make_generator, penalize_seen, token_counts

TWIN = Sampler(native=False)
NATIVE = Sampler(native=True)


def random_rows(rng: random.Random, n_rows: int, n_vocab: int) -> torch.Tensor:
    x = torch.randn(n_rows, n_vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    x *= rng.choice([0.5, 2.0, 6.0])  # flat to peaked distributions
    for r in range(n_rows):
        if rng.random() < 0.3:  # banned tokens
            x[r, rng.sample(range(n_vocab), n_vocab // 10)] = -math.inf
        if rng.random() < 0.3:  # exact ties, as quantized logits have
            x[r] = torch.round(x[r] * 2) / 2
    return x


def random_params(rng: random.Random, n_vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.1, 0.7, 1.0, 1.5]),
        top_k=rng.choice([1, 2, 5, 40, min(200, n_vocab - 1)]),
        top_p=rng.choice([1.0, 0.95, 0.5, 0.1]),
        min_p=rng.choice([0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.1, 0.8]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3]),
        penalty_last_n=rng.choice([-1, 8, 64]),
    )


def test_the_native_draws_are_the_twins_on_thousands_of_rows(ops: Any) -> None:
    rng = random.Random(7)
    drawn = 0
    for _ in range(60):
        n_rows, n_vocab = rng.choice([1, 3, 16]), rng.choice([50, 300, 4096])
        x = random_rows(rng, n_rows, n_vocab)
        params = [random_params(rng, n_vocab) for _ in range(n_rows)]
        histories = [[rng.randrange(n_vocab) for _ in range(rng.randrange(40))] for _ in range(n_rows)]
        seeds = [rng.randrange(1 << 32) for _ in range(n_rows)]
        for _ in range(3):  # three draws a row, each generator moving on
            a = NATIVE.sample(x, params, histories, [make_generator(s) for s in seeds])
            b = TWIN.sample(x, params, histories, [make_generator(s) for s in seeds])
            assert a.tokens == b.tokens and a.errors == b.errors
            drawn += n_rows
            seeds = [s + 1 for s in seeds]
    assert drawn > 1000


def test_a_row_draws_the_same_alone_and_in_a_batch(ops: Any) -> None:
    rng = random.Random(3)
    x = random_rows(rng, 8, 500)
    params = [random_params(rng, 500) for _ in range(8)]
    histories = [[rng.randrange(500) for _ in range(20)] for _ in range(8)]
    together = NATIVE.sample(x, params, histories, [make_generator(k) for k in range(8)]).tokens
    alone = [
        NATIVE.sample(x[k : k + 1], params[k : k + 1], histories[k : k + 1], [make_generator(k)]).tokens[0]
        for k in range(8)
    ]
    assert together == alone


def test_native_penalties_are_the_dense_arithmetic_bit_for_bit(ops: Any) -> None:
    rng = random.Random(5)
    n_vocab = 64
    x = random_rows(rng, 4, n_vocab)
    x[0, :8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.5, -2.25, -math.inf, 1e-30])
    params = [random_params(rng, n_vocab) for _ in range(4)]
    histories = [[rng.randrange(n_vocab) for _ in range(50)] for _ in range(4)]
    histories[0] += list(range(8))
    dense = apply_penalties(
        x.clone(), token_counts(histories, [p.penalty_last_n for p in params], n_vocab), params
    )
    mine = x.clone()
    penalize_seen(mine, range(4), histories, params, ops)
    assert torch.equal(mine, dense)


def test_the_sampled_path_reaches_the_native_op(ops: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = ops.sampler_top_k_draw

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(ops, name)

        def sampler_top_k_draw(self, *args: Any) -> Any:
            calls.append(args[1])
            return real(*args)

    monkeypatch.setattr("rsmem.engine.sampling.loaded_native_ops", lambda: Spy())
    x = torch.randn(2, 100)
    params = [SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=0.8, top_k=0, top_p=0.9)]
    NATIVE.sample(x, params, [[], []], [make_generator(1), make_generator(2)])
    assert calls == [[0]]  # the top-k row; the nucleus row without top-k stays with torch


def test_seeded_generation_is_the_twins(ops: Any) -> None:
    llm = LLM(n_seq_max=4)
    cli = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)  # rsmem generate's
    params = [SamplingParams(**cli, max_tokens=48, seed=s, ignore_eos=True) for s in range(4)]
    prompts = ["ROMEO:", "JULIET:", "To be", "KING:"]
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.output.sampler = TWIN
    twin = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert native == twin
