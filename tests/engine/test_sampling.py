"""Sampler stages against direct computations on small fixed logits, plus seeding and distribution checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rsmem.engine import Sampler, SamplingParams, make_generator
from rsmem.engine import truncation as truncation_mod
from rsmem.engine.output import penalty_window
from rsmem.engine.sampling import apply_penalties, penalize_seen, token_counts

V = 10
# Distinct logits in a scrambled order so that sorting actually matters.
LOGITS = torch.tensor([[1.0, 3.0, -0.5, 2.2, 0.3, 2.9, -2.0, 1.7, 0.0, 0.8]])
SAMPLER = Sampler()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def dist(
    params: SamplingParams, logits: torch.Tensor = LOGITS, history: list[int] | None = None
) -> np.ndarray:
    histories = None if history is None else [history]
    return SAMPLER.distribution(logits, [params], histories)[0].double().numpy()


def raw_logprobs(params: SamplingParams, history: list[int] | None = None) -> np.ndarray:
    """The adjusted (bias + penalty) log-softmax as reported through logprobs, indexed by token."""
    params = SamplingParams(**{**_fields(params), "logprobs": V})
    out = SAMPLER.sample(LOGITS, [params], None if history is None else [history])
    lp = np.full(V, np.nan)
    for token, value in out.logprobs[0].top:
        lp[token] = value
    return lp


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in p.__slots__}


# ------------------------------------------------------------------ params


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", math.inf),
        ("frequency_penalty", "x"),
        ("penalty_last_n", -2),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: math.nan}),
        ("logit_bias", {1: math.inf}),
        ("logit_bias", [(1, 1.0), (1, 2.0)]),
        ("logit_bias", 5),
        ("seed", 2**64),
        ("seed", 1.5),
        ("logprobs", -1),
        ("max_tokens", 0),
        ("stop", ("",)),
        ("stop", (1,)),
        ("n", 0),
        ("ignore_eos", 1),
    ],
)
def test_invalid_params_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_normalise_and_stay_hashable() -> None:
    p = SamplingParams(temperature=1, logit_bias={5: -math.inf, 2: 1}, stop="END")
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.logit_bias == ((2, 1.0), (5, -math.inf))
    assert p.stop == ("END",)
    assert hash(p) == hash(
        SamplingParams(temperature=1.0, logit_bias=[(5, -math.inf), (2, 1.0)], stop=["END"])
    )
    assert SamplingParams(logit_bias={}).logit_bias is None
    g = SamplingParams.greedy(top_k=3)
    assert g.is_greedy and g.top_k == 3
    assert not SamplingParams(repetition_penalty=1.2, penalty_last_n=0).has_penalties
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]


# ------------------------------------------------------------------ stages


def test_greedy_is_argmax_first_on_ties() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, -1.0, 0.0, 2.0]])
    greedy = SamplingParams.greedy()
    assert SAMPLER.sample(logits, [greedy, greedy]).tokens == [1, 0]  # fast path
    slow = SamplingParams.greedy(logprobs=0)
    assert SAMPLER.sample(logits, [slow, slow]).tokens == [1, 0]
    assert SAMPLER.sample(LOGITS, [greedy]).tokens == [int(np.argmax(LOGITS[0].numpy()))]


def test_temperature_scales_logits() -> None:
    for t in (0.5, 1.0, 2.0):
        np.testing.assert_allclose(
            dist(SamplingParams(temperature=t)), softmax(LOGITS[0].numpy() / t), rtol=1e-5
        )


@pytest.mark.parametrize("k", [1, 3, 7, V, V + 5])
def test_top_k_keeps_exactly_k(k: int) -> None:
    x = LOGITS[0].numpy()
    keep = np.argsort(-x)[: min(k, V)]
    expected = np.zeros(V)
    expected[keep] = softmax(x[keep])
    got = dist(SamplingParams(top_k=k))
    assert (got > 0).sum() == min(k, V)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_minimal_prefix_reaching_p(p: float) -> None:
    x = LOGITS[0].numpy().astype(np.float64)
    order = np.argsort(-x)
    probs = softmax(x)[order]
    n = int(np.searchsorted(np.cumsum(probs), p) + 1)  # smallest n with mass >= p
    assert probs[: n - 1].sum() < p <= probs[:n].sum()
    keep = order[:n]
    expected = np.zeros(V)
    expected[keep] = softmax(x[keep])
    np.testing.assert_allclose(dist(SamplingParams(top_p=p)), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("m", [0.05, 0.2, 0.5, 0.9, 1.0])
def test_min_p_threshold_relative_to_max_prob(m: float) -> None:
    x = LOGITS[0].numpy().astype(np.float64)
    probs = softmax(x)
    keep = probs >= m * probs.max()
    expected = np.where(keep, np.exp(x - x.max()), 0.0)
    np.testing.assert_allclose(dist(SamplingParams(min_p=m)), expected / expected.sum(), rtol=1e-5, atol=1e-7)


def test_chain_order_truncation_before_temperature() -> None:
    x = LOGITS[0].numpy().astype(np.float64)
    # top-k 5 -> top-p 0.7 (on the T=1 distribution of the 5) -> min-p 0.3 -> temperature 0.5
    top5 = np.argsort(-x)[:5]
    p5 = softmax(x[top5])
    n = int(np.searchsorted(np.cumsum(p5), 0.7) + 1)
    kept = top5[:n]
    kept = kept[np.exp(x[kept] - x[kept].max()) >= 0.3]
    expected = np.zeros(V)
    expected[kept] = softmax(x[kept] / 0.5)
    got = dist(SamplingParams(top_k=5, top_p=0.7, min_p=0.3, temperature=0.5))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    x = LOGITS[0].numpy().astype(np.float64)
    history = [1, 2, 2, 8]  # 3.0 (positive), -0.5 (negative, twice), 0.0
    adjusted = x.copy()
    adjusted[1] /= 1.5
    adjusted[2] *= 1.5
    adjusted[8] *= 1.5
    lp = raw_logprobs(SamplingParams(repetition_penalty=1.5), history)
    np.testing.assert_allclose(lp, np.log(softmax(adjusted)), atol=1e-5)


def test_presence_and_frequency_penalties() -> None:
    x = LOGITS[0].numpy().astype(np.float64)
    history = [3, 3, 3, 5, 0]
    counts = np.bincount(history, minlength=V)
    adjusted = x - 0.4 * (counts > 0) - 0.25 * counts
    lp = raw_logprobs(SamplingParams(presence_penalty=0.4, frequency_penalty=0.25), history)
    np.testing.assert_allclose(lp, np.log(softmax(adjusted)), atol=1e-5)
    # Direct numeric values of the penalty stage.
    params = [SamplingParams(presence_penalty=0.4, frequency_penalty=0.25, repetition_penalty=2.0)]
    out = apply_penalties(LOGITS.clone(), token_counts([history], [-1], V), params)[0].double().numpy()
    assert out[3] == pytest.approx(2.2 / 2 - 0.4 - 0.75)
    assert out[5] == pytest.approx(2.9 / 2 - 0.4 - 0.25)
    assert out[0] == pytest.approx(1.0 / 2 - 0.4 - 0.25)
    assert out[1] == pytest.approx(3.0)


def test_penalty_window_counts_only_last_n() -> None:
    history = [1, 1, 2, 3, 3, 3]
    counts = token_counts([history, history, history, torch.tensor(history)], [-1, 0, 4, 2], V)
    assert counts[0, :4].tolist() == [0, 2, 1, 3]
    assert counts[1].sum() == 0
    assert counts[2, :4].tolist() == [0, 0, 1, 3]
    assert counts[3, :4].tolist() == [0, 0, 0, 2]
    with pytest.raises(ValueError, match="outside"):
        token_counts([[V]], [-1], V)


def test_logit_bias_adds_and_bans() -> None:
    x = LOGITS[0].numpy().astype(np.float64)
    adjusted = x.copy()
    adjusted[1] = -np.inf
    adjusted[6] += 10.0
    p = SamplingParams(logit_bias={1: -math.inf, 6: 10.0})
    np.testing.assert_allclose(dist(p), softmax(adjusted), atol=1e-6)
    assert SAMPLER.sample(LOGITS, [SamplingParams.greedy(logit_bias={6: 10.0})]).tokens == [6]
    banned = SamplingParams(logit_bias={t: -math.inf for t in range(V - 1)})
    gens = [make_generator(0)]
    assert all(SAMPLER.sample(LOGITS, [banned], generators=gens).tokens == [V - 1] for _ in range(20))
    with pytest.raises(ValueError, match="vocabulary"):
        SAMPLER.sample(LOGITS, [SamplingParams(logit_bias={V: 1.0})])
    out = SAMPLER.sample(LOGITS, [SamplingParams(logit_bias={t: -math.inf for t in range(V)})])
    assert out.tokens == [-1] and "banned" in out.errors[0]


def test_logprobs_are_log_softmax_of_adjusted_logits() -> None:
    logits = torch.randn(3, V, generator=make_generator(7))
    params = [SamplingParams(logprobs=3), SamplingParams.greedy(logprobs=0), SamplingParams(seed=1)]
    out = SAMPLER.sample(logits, params, generators=[make_generator(i) for i in range(3)])
    expected = torch.log_softmax(logits, dim=-1)
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    assert lp0 is not None and lp1 is not None and out.logprobs[2] is None
    assert lp0.logprob == pytest.approx(float(expected[0, out.tokens[0]]), abs=1e-6)
    top = torch.topk(expected[0], 3)
    assert [t for t, _ in lp0.top] == top.indices.tolist()
    np.testing.assert_allclose([v for _, v in lp0.top], top.values.numpy(), atol=1e-6)
    assert lp1.top == () and lp1.token == int(torch.argmax(logits[1]))
    assert lp1.logprob == pytest.approx(float(expected[1].max()), abs=1e-6)


def test_input_checks() -> None:
    with pytest.raises(ValueError, match="histories"):
        SAMPLER.sample(LOGITS, [SamplingParams(repetition_penalty=1.1)])
    with pytest.raises(ValueError, match="SamplingParams"):
        SAMPLER.sample(LOGITS, [])
    with pytest.raises(ValueError, match="floating"):
        SAMPLER.sample(torch.zeros(1, V, dtype=torch.long), [SamplingParams()])
    assert SAMPLER.sample(torch.zeros(0, V), []).tokens == []


# ------------------------------------------------------------------ seeding and distribution


MIXED = [
    SamplingParams(seed=11),
    SamplingParams(top_k=3, temperature=0.7),
    SamplingParams(top_p=0.8, min_p=0.05, repetition_penalty=1.3),
    SamplingParams.greedy(),
    SamplingParams(top_k=5, frequency_penalty=0.5, logit_bias={1: -2.0}, logprobs=2),
]


def _run(rows: list[int], logits: torch.Tensor, steps: int = 15) -> dict[int, list[int]]:
    """Sample ``steps`` tokens for the given rows of MIXED, each with its own seeded generator."""
    gens = [make_generator(1000 + r) for r in rows]
    hist: dict[int, list[int]] = {r: [0, 1, 2] for r in rows}
    for step in range(steps):
        out = SAMPLER.sample(logits[step][rows], [MIXED[r] for r in rows], [hist[r] for r in rows], gens)
        for r, t in zip(rows, out.tokens, strict=True):
            hist[r].append(t)
    return hist


def test_seeds_reproduce_independent_of_batch_composition() -> None:
    logits = torch.randn(15, len(MIXED), 64, generator=make_generator(3)) * 2
    together = _run(list(range(len(MIXED))), logits)
    assert together == _run(list(range(len(MIXED))), logits)
    for r in range(len(MIXED)):
        assert _run([r], logits)[r] == together[r]
    assert _run([4, 0, 2], logits) == {r: together[r] for r in (4, 0, 2)}
    assert len(set(together[0][3:])) > 1  # it is actually sampling


def test_empirical_distribution_matches_probabilities() -> None:
    params = SamplingParams(top_k=8, temperature=1.3)
    expected = dist(params)
    n = 20_000
    g = make_generator(12345)
    out = SAMPLER.sample(LOGITS.expand(n, V), [params] * n, generators=[g] * n)
    observed = np.bincount(out.tokens, minlength=V)
    assert observed[expected == 0].sum() == 0
    support = expected > 0
    chi2 = (((observed - n * expected) ** 2)[support] / (n * expected[support])).sum()
    assert chi2 < 26.1  # chi-square critical value, 7 degrees of freedom, p = 0.001


def test_pruned_nucleus_matches_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    g = make_generator(5)
    logits = torch.randn(12, 300, generator=g) * torch.linspace(0.5, 8, 12).unsqueeze(1)
    logits[3, :40] = 7.0  # a tie that straddles the partial sort's boundary
    params = [SamplingParams(top_p=p, min_p=m) for p in (0.5, 0.9, 0.99) for m in (0.0, 0.01, 0.2, 0.0)]
    monkeypatch.setattr(truncation_mod, "PRUNE_WIDTHS", (8, 32))
    pruned = SAMPLER.distribution(logits, params)
    pruned_tokens = SAMPLER.sample(logits, params, generators=[make_generator(i) for i in range(12)]).tokens
    monkeypatch.setattr(truncation_mod, "PRUNE_WIDTHS", ())
    full = SAMPLER.distribution(logits, params)
    full_tokens = SAMPLER.sample(logits, params, generators=[make_generator(i) for i in range(12)]).tokens
    assert torch.equal(pruned > 0, full > 0)
    torch.testing.assert_close(pruned, full)
    assert pruned_tokens == full_tokens


# ------------------------------------------------------------------ properties

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([0.1, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    logit_bias=st.dictionaries(st.integers(0, V - 2), st.sampled_from([-math.inf, -1.0, 2.0]), max_size=4),
)


@pytest.mark.fuzz
@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(params_strategy, st.integers(0, 2**32)), min_size=1, max_size=5),
    data=st.data(),
)
def test_sampled_token_is_always_allowed_and_batch_independent(rows: list, data: st.DataObject) -> None:
    params = [p for p, _ in rows]
    logits = torch.tensor(
        data.draw(
            st.lists(
                st.lists(st.floats(-5, 5), min_size=V, max_size=V), min_size=len(rows), max_size=len(rows)
            )
        )
    )
    histories = [data.draw(st.lists(st.integers(0, V - 1), max_size=6)) for _ in rows]
    probs = SAMPLER.distribution(logits, params, histories)
    out = SAMPLER.sample(logits, params, histories, [make_generator(s) for _, s in rows])
    for i, (p, seed) in enumerate(rows):
        token = out.tokens[i]
        assert probs[i, token] > 0
        assert dict(p.logit_bias or ()).get(token) != -math.inf
        if p.top_k:
            assert (probs[i] > 0).sum() <= p.top_k
        alone = SAMPLER.sample(logits[i : i + 1], [p], [histories[i]], [make_generator(seed)])
        assert alone.tokens == [token]


def test_a_row_that_cannot_be_sampled_leaves_the_other_rows_and_their_generators_alone() -> None:
    """A bad row is reported, not raised, and no generator draws twice (seeded neighbours unchanged)."""
    good = SamplingParams(temperature=0.8, seed=5)
    banned = SamplingParams(temperature=0.8, logit_bias={t: -math.inf for t in range(V)})
    batch = torch.stack([LOGITS[0], LOGITS[0], LOGITS[0]])
    alone = [SAMPLER.sample(LOGITS[:1], [good], generators=[make_generator(5)]).tokens[0] for _ in range(1)]
    gens = [make_generator(5), make_generator(1), make_generator(5)]
    first = SAMPLER.sample(batch, [good, banned, good], generators=gens)
    assert first.tokens[0] == first.tokens[2] == alone[0] and first.tokens[1] == -1
    assert first.errors[0] is None and first.errors[1] is not None
    solo = make_generator(5)
    SAMPLER.sample(LOGITS[:1], [good], generators=[solo])
    second = SAMPLER.sample(batch, [good, banned, good], generators=gens)
    assert second.tokens[0] == SAMPLER.sample(LOGITS[:1], [good], generators=[solo]).tokens[0]


def test_tiny_top_p_and_temperature_are_greedy_not_errors() -> None:
    """top_p that rounds to 0 in float32 keeps the head; a temperature below 1e-5 is greedy."""
    best = int(torch.argmax(LOGITS[0]))
    for params in (
        SamplingParams(top_p=1e-300, seed=1),
        SamplingParams(top_p=1e-300, min_p=1.0, seed=1),
        SamplingParams(temperature=1e-300, seed=1, logprobs=2),
        SamplingParams(temperature=1e-38, seed=1),
        SamplingParams(temperature=1e-5, seed=1),
    ):
        out = SAMPLER.sample(LOGITS[:1], [params], generators=[make_generator(1)])
        assert out.tokens == [best] and out.errors == [None], params


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 49), max_size=30), min_size=1, max_size=4),
    st.lists(st.integers(-1, 12), min_size=4, max_size=4),
    st.floats(0.5, 2.0),
    st.floats(-1.0, 1.0),
    st.floats(-1.0, 1.0),
)
def test_sparse_penalties_are_the_dense_ones_bit_for_bit(histories, windows, rep, presence, frequency):
    n_vocab = 50
    x = torch.randn(len(histories), n_vocab, generator=torch.Generator().manual_seed(len(histories)))
    x[0, 3] = 0.0
    x[0, 4] = -math.inf
    params = [
        SamplingParams(
            repetition_penalty=rep,
            presence_penalty=presence,
            frequency_penalty=frequency,
            penalty_last_n=windows[k] if windows[k] != 0 else 1,
        )
        for k in range(len(histories))
    ]
    counts = token_counts(histories, [p.penalty_last_n for p in params], n_vocab)
    dense = apply_penalties(x.clone(), counts, params)
    sparse = x.clone()
    penalize_seen(sparse, list(range(len(histories))), histories, params)
    assert torch.equal(dense, sparse)


@given(
    st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=12), st.integers(-1, 30)
)
def test_penalty_window_is_the_tail_of_prompt_and_output(prompt, generated, n):
    whole = prompt + generated
    assert penalty_window(prompt, generated, n) == (
        whole if n < 0 else whole[max(0, len(whole) - n) :] if n else []
    )


def test_a_window_longer_than_the_history_counts_all_of_it():
    history = list(range(40))  # more than half of the window: a negative slice start would drop the first
    counts = token_counts([history], [64], 50)
    assert counts[0, :40].tolist() == [1.0] * 40
