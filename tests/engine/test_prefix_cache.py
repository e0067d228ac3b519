"""The prefix cache against a plain dictionary model, and unit tests of its tree, budget, pins and stats.

The model keeps ``tuple(tokens) -> record`` and answers every query by brute force from the module's
documented rules (longest stored prefix, longest common prefix with any key, the score formula, pins),
never from the cache's answers. Eviction is predicted exactly where the scores order the candidates
unambiguously; where two different entries score within 1e-9 of each other (float rounding could order
them either way) the cache's choice is checked against the rule instead: everything evicted scores no
higher than everything kept, and one fewer victim would not have made room.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rsmem.engine.prefix_cache import CacheStats, Handle, PrefixCache

BUDGET = 100
HALF_LIFE = 50.0
REL = 1e-9
Key = tuple[int, ...]


@dataclass(eq=False)
class Blob:
    nbytes: int
    tag: str = ""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rec:
    """The model's view of one checkpoint."""

    payload: Blob
    handle: Handle
    kind: str
    last_used: float
    seq: int  # the model's own insertion counter: later (re)insertions are "younger handles"
    hits: int = 0
    pins: int = 0


def lcp(a: Key, b: Key) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def score(key: Key, r: Rec, now: float) -> float:
    """The documented formula: (1 + hits) * n_tokens * 0.5 ** (age / half_life) / max(nbytes, 1)."""
    return (1 + r.hits) * len(key) * 2.0 ** (-(now - r.last_used) / HALF_LIFE) / max(r.payload.nbytes, 1)


def expected_nodes(keys: set[Key]) -> int:
    """A compressed trie's nodes (root excluded): every key, and every prefix where keys branch."""
    prefixes = {k[:n] for k in keys for n in range(1, len(k) + 1)}
    branching = {
        p for p in prefixes if len({k[len(p)] for k in keys if len(k) > len(p) and k[: len(p)] == p}) > 1
    }
    return len(keys | branching)


kinds_st = st.sampled_from(["prompt", "message", "divergence"])
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=8)
nbytes_st = st.integers(0, 39).map(lambda n: n % 8 if n < 32 else 9 + (n - 32) * 17)  # mostly small: many fit


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.cache: PrefixCache[Blob] = PrefixCache(BUDGET, self.clock, half_life=HALF_LIFE)
        self.model: dict[Key, Rec] = {}
        self.dead: list[Handle] = []  # handles of checkpoints that are gone
        self.seqs = itertools.count()
        self.stats = CacheStats()

    # ------------------------------------------------------------- helpers

    def held(self) -> set[Key]:
        return {k for k, _, _ in self.cache.items()}

    def pick(self, data: st.DataObject, *, pinned: bool | None = None) -> Key:
        keys = sorted(k for k, r in self.model.items() if pinned is None or (r.pins > 0) == pinned)
        return data.draw(st.sampled_from(keys), label="key")

    def query(self, data: st.DataObject) -> list[int]:
        """Random tokens, or a stored key cut or extended (to land on and around stored prefixes)."""
        if len(self.model) > 0 and data.draw(st.booleans(), label="near a key"):
            key = self.pick(data)
            cut = data.draw(st.one_of(st.just(len(key)), st.integers(0, len(key))), label="cut")
            return list(key[:cut]) + data.draw(st.lists(st.integers(0, 3), max_size=4), label="suffix")
        return data.draw(tokens_st, label="tokens")

    def forget(self, keys: set[Key]) -> None:
        for k in keys:
            self.dead.append(self.model.pop(k).handle)

    def check_eviction(self, victims: set[Key], candidates: list[Key], need: int, *, partial: bool) -> None:
        """``victims`` (what the cache dropped) against the rule, for a request to free ``need`` bytes."""
        now = self.clock.now
        assert victims <= set(candidates), "evicted a pinned checkpoint or the one being replaced"
        total = sum(self.model[k].payload.nbytes for k in candidates)
        if need <= 0:
            assert victims == set()
            return
        if total < need:
            assert partial
            assert victims == set(candidates)
            return
        order = sorted(
            candidates,
            key=lambda k: (score(k, self.model[k], now), self.model[k].last_used, self.model[k].seq),
        )
        expected: set[Key] = set()
        left = need
        for k in order:
            if left <= 0:
                break
            expected.add(k)
            left -= self.model[k].payload.nbytes

        def inputs(k: Key) -> tuple[int, int, int, float]:
            r = self.model[k]
            return (r.hits, len(k), r.payload.nbytes, r.last_used)

        def ambiguous(j: Key, k: Key) -> bool:  # close scores from different inputs: rounding may order them
            a, b = score(j, self.model[j], now), score(k, self.model[k], now)
            return abs(b - a) <= REL * max(abs(a), abs(b)) and inputs(j) != inputs(k)

        if not any(ambiguous(j, k) for j, k in itertools.pairwise(order)):
            assert victims == expected
            return
        kept = set(candidates) - victims
        for v in victims:
            for s in kept:
                assert score(v, self.model[v], now) <= score(s, self.model[s], now) * (1 + REL)
        freed = sum(self.model[v].payload.nbytes for v in victims)
        top = max(score(v, self.model[v], now) for v in victims)
        assert freed >= need
        assert any(
            freed - self.model[v].payload.nbytes < need
            for v in victims
            if score(v, self.model[v], now) >= top * (1 - REL)
        )

    # ------------------------------------------------------------- rules

    @initialize(data=st.data(), n=st.integers(0, 10))
    def populate(self, data: st.DataObject, n: int) -> None:
        """Starts from a few checkpoints (hypothesis's swarm testing may disable ``insert`` in a run)."""
        for _ in range(n):
            self.insert(data, data.draw(nbytes_st, label="nbytes"), data.draw(kinds_st, label="kind"))

    @rule(data=st.data(), nbytes=nbytes_st, kind=kinds_st)
    def insert(self, data: st.DataObject, nbytes: int, kind: str) -> None:
        key = tuple(self.query(data) or [0])
        payload = Blob(nbytes, f"{key}@{self.clock.now}")
        old = self.model.get(key)
        candidates = [k for k, r in self.model.items() if r.pins == 0 and k != key]
        need = sum(r.payload.nbytes for k, r in self.model.items() if k != key) + nbytes - BUDGET
        refused = (old is not None and old.pins > 0) or sum(
            self.model[k].payload.nbytes for k in candidates
        ) < need
        before = self.held()
        handle = self.cache.insert(list(key), payload, kind=kind)
        if refused:
            assert handle is None
            assert self.held() == before
            return
        assert handle is not None
        victims = set(self.model) - self.held()
        self.check_eviction(victims, candidates, need, partial=False)
        self.stats.evictions += len(victims)
        self.stats.insertions += 1
        self.forget(victims)
        if old is not None:
            self.dead.append(old.handle)
        hits = 0 if old is None else old.hits
        self.model[key] = Rec(payload, handle, kind, self.clock.now, next(self.seqs), hits=hits)

    @rule(data=st.data(), proper=st.booleans(), touch=st.booleans())
    def match(self, data: st.DataObject, proper: bool, touch: bool) -> None:
        toks = self.query(data)
        limit = len(toks) - 1 if proper else len(toks)
        found = self.cache.match(toks, max_len=limit if proper else None, touch=touch)
        prefixes = [k for k in self.model if len(k) <= limit and tuple(toks[: len(k)]) == k]
        if not prefixes:
            assert found is None
            self.stats.misses += touch
            return
        best = max(prefixes, key=len)
        rec = self.model[best]
        assert found is not None
        assert (found.n_tokens, found.handle, found.kind) == (len(best), rec.handle, rec.kind)
        assert found.payload is rec.payload
        if touch:
            rec.hits += 1
            rec.last_used = self.clock.now
            self.stats.hits[rec.kind] = self.stats.hits.get(rec.kind, 0) + 1

    @rule(data=st.data())
    def divergence(self, data: st.DataObject) -> None:
        toks = tuple(self.query(data))
        assert self.cache.divergence(toks) == max((lcp(k, toks) for k in self.model), default=0)

    @rule(data=st.data())
    def along(self, data: st.DataObject) -> None:
        toks = tuple(self.query(data))
        expected = sorted(len(k) for k in self.model if 0 < len(k) <= len(toks) and toks[: len(k)] == k)
        assert list(self.cache.along(toks)) == expected

    @rule(data=st.data(), n_bytes=st.one_of(st.integers(-5, 20), st.integers(21, BUDGET + 10)))
    def evict(self, data: st.DataObject, n_bytes: int) -> None:
        candidates = [k for k, r in self.model.items() if r.pins == 0]
        freed = self.cache.evict(n_bytes)
        victims = set(self.model) - self.held()
        self.check_eviction(victims, candidates, n_bytes, partial=True)
        assert freed == sum(self.model[k].payload.nbytes for k in victims)
        self.stats.evictions += len(victims)
        self.forget(victims)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = self.pick(data)
        rec = self.model[key]
        assert self.cache.remove(rec.handle) == (rec.pins == 0)
        if rec.pins == 0:
            self.forget({key})

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def remove_stale(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.dead), label="stale")
        assert handle not in self.cache
        assert self.cache.remove(handle) is False

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = self.pick(data)
        self.cache.pin(self.model[key].handle)
        self.model[key].pins += 1

    @precondition(lambda self: any(r.pins for r in self.model.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = self.pick(data, pinned=True)
        self.cache.unpin(self.model[key].handle)
        self.model[key].pins -= 1

    @precondition(lambda self: len(self.model) > 6)
    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.forget({k for k, r in self.model.items() if r.pins == 0})

    @rule(dt=st.sampled_from([0.0, 1.0, 7.5, 50.0, 400.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    # ------------------------------------------------------------- invariants

    @invariant()
    def contents(self) -> None:
        items = {k: (p, kind) for k, p, kind in self.cache.items()}
        assert items.keys() == self.model.keys()
        for k, (payload, kind) in items.items():
            assert payload is self.model[k].payload and kind == self.model[k].kind
        assert len(self.cache) == len(self.model)

    @invariant()
    def budget(self) -> None:
        assert self.cache.nbytes == sum(r.payload.nbytes for r in self.model.values()) <= BUDGET

    @invariant()
    def compressed(self) -> None:
        assert self.cache.n_nodes == expected_nodes(set(self.model))

    @invariant()
    def stats_agree(self) -> None:
        self.stats.bytes = sum(r.payload.nbytes for r in self.model.values())
        self.stats.entries = len(self.model)
        assert self.cache.stats == self.stats


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPrefixCacheMachine = pytest.mark.fuzz(PrefixCacheMachine.TestCase)


# ----------------------------------------------------------------- unit tests


def make(budget: int = 1000, half_life: float = 300.0) -> tuple[PrefixCache[Blob], Clock]:
    clock = Clock()
    return PrefixCache(budget, clock, half_life=half_life), clock


def test_tree_compression_after_inserts_and_removals() -> None:
    cache, _ = make()
    a = cache.insert([1, 2, 3, 4], Blob(1))
    assert cache.n_nodes == 1
    b = cache.insert([1, 2, 5, 6], Blob(1))
    assert cache.n_nodes == 3  # the branch at [1, 2] and two leaves
    c = cache.insert([1, 2], Blob(1))
    assert cache.n_nodes == 3  # the branch now holds a checkpoint
    d = cache.insert([1, 2, 3, 4, 7, 8, 9], Blob(1))
    assert cache.n_nodes == 4
    assert a and b and c and d
    assert cache.remove(a)  # [1, 2, 3, 4] is left with one child: merged into it
    assert cache.n_nodes == 3
    assert cache.remove(c)  # [1, 2] still branches: stays as a plain node
    assert cache.n_nodes == 3
    assert cache.remove(b)  # [1, 2] is left with one child: merged
    assert cache.n_nodes == 1
    m = cache.match([1, 2, 3, 4, 7, 8, 9, 10])
    assert m is not None and m.n_tokens == 7 and m.handle == d
    assert cache.match([1, 2, 3, 4, 7, 8], touch=False) is None
    assert cache.divergence([1, 2, 3, 4, 7, 0]) == 5
    assert cache.remove(d)
    assert cache.n_nodes == 0 and len(cache) == 0 and cache.divergence([1, 2]) == 0


def test_a_long_key_is_one_node_and_splits_in_the_middle() -> None:
    cache, _ = make()
    long = list(range(100_000))
    cache.insert(long, Blob(1))
    assert cache.n_nodes == 1
    fork = [*long[:50_000], -1]
    cache.insert(fork, Blob(1))
    assert cache.n_nodes == 3
    assert cache.divergence([*long[:70_000], -5]) == 70_000
    m = cache.match([*long[:50_000], -1, 3])
    assert m is not None and m.n_tokens == 50_001
    assert cache.match(long, max_len=len(long) - 1) is None  # no proper prefix stored


def test_match_max_len_keeps_a_token_to_compute() -> None:
    cache, _ = make()
    cache.insert([1, 2], Blob(1), kind="message")
    cache.insert([1, 2, 3], Blob(1))
    m = cache.match([1, 2, 3], max_len=2)
    assert m is not None and (m.n_tokens, m.kind) == (2, "message")
    m = cache.match([1, 2, 3])
    assert m is not None and m.n_tokens == 3
    assert cache.match([1, 2, 3], max_len=1) is None
    assert cache.match([], max_len=-1) is None


def test_budget_edges() -> None:
    cache, _ = make(budget=100)
    first = cache.insert([1], Blob(40))
    cache.insert([2], Blob(60))
    assert first is not None and cache.nbytes == 100 and len(cache) == 2
    assert cache.insert([3], Blob(101)) is None  # alone over the budget: nothing evicted, nothing stored
    assert (len(cache), cache.nbytes, cache.stats.evictions) == (2, 100, 0)
    assert cache.insert([3], Blob(100)) is not None  # exactly the budget: everything else goes
    assert (len(cache), cache.nbytes, cache.stats.evictions) == (1, 100, 2)
    assert first not in cache and cache.remove(first) is False
    zero, _ = make(budget=0)
    assert zero.insert([1], Blob(0)) is not None
    assert zero.insert([2], Blob(1)) is None
    assert zero.nbytes == 0 and len(zero) == 1
    with pytest.raises(ValueError):
        zero.insert([], Blob(0))
    with pytest.raises(ValueError):
        zero.insert([1], Blob(-1))
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_pinned_checkpoints_stay() -> None:
    cache, _ = make(budget=100)
    pinned = cache.insert([1, 2, 3], Blob(70))
    other = cache.insert([4], Blob(20))
    assert pinned and other
    cache.pin(pinned)
    assert cache.insert([5], Blob(40)) is None  # would need the pinned bytes: refused, `other` kept
    assert other in cache and cache.stats.evictions == 0
    assert cache.insert([1, 2, 3], Blob(10)) is None  # a pinned key is not replaced
    assert cache.remove(pinned) is False
    assert cache.evict(1000) == 20 and other not in cache
    cache.clear()
    assert pinned in cache and cache.nbytes == 70
    cache.unpin(pinned)
    with pytest.raises(ValueError):
        cache.unpin(pinned)
    assert cache.insert([5], Blob(40)) is not None and pinned not in cache
    with pytest.raises(KeyError):
        cache.pin(pinned)


def test_replacement_keeps_hits_and_renews_the_handle() -> None:
    cache, _ = make(budget=100)
    old = cache.insert([1, 2], Blob(30))
    assert old is not None and cache.match([1, 2, 3]) is not None
    new_payload = Blob(50)
    new = cache.insert([1, 2], new_payload, kind="message")
    assert new is not None and new != old and old not in cache
    assert (len(cache), cache.nbytes, cache.n_nodes) == (1, 50, 1)
    other = cache.insert([9, 9], Blob(50))  # fits beside the replacement: no eviction
    assert other is not None and cache.stats.evictions == 0
    m = cache.match([1, 2], touch=False)
    assert m is not None and m.payload is new_payload and m.kind == "message"
    # the key's hit survived: (1 + 1) * 2 / 50 beats (1 + 0) * 2 / 50 (without it, the older handle would go)
    cache.insert([3, 4], Blob(50))
    assert new in cache and other not in cache


def test_eviction_order_follows_value_per_byte() -> None:
    cache, clock = make(budget=10_000, half_life=10.0)
    short = cache.insert([1], Blob(100))
    long = cache.insert([2] * 10, Blob(100))
    big = cache.insert([3] * 10, Blob(400))
    hit = cache.insert([4], Blob(100))
    for _ in range(4):
        cache.match([4])
    clock.now = 10.0  # one half-life later
    fresh = cache.insert([5] * 10, Blob(100))
    # scores: short 1 * .5 / 100, big 10 * .5 / 400, hit 5 * 1 * .5 / 100, long 10 * .5 / 100, fresh 10 / 100
    order: list[Handle | None] = []
    while len(cache):
        before = [h for h in (short, long, big, hit, fresh) if h in cache]
        assert cache.evict(1) >= 1
        order.extend(h for h in before if h not in cache)
    assert order == [short, big, hit, long, fresh]


def test_equal_scores_evict_the_least_recently_used_then_the_oldest() -> None:
    cache, clock = make(budget=300, half_life=1e300)  # recency changes no score, only breaks ties
    a = cache.insert([1], Blob(100))
    b = cache.insert([2], Blob(100))
    c = cache.insert([3], Blob(100))
    cache.insert([4], Blob(100))
    assert a not in cache and b in cache and c in cache  # equal scores, equal recency: the oldest handle
    cache.clear()
    older = cache.insert([5], Blob(200))
    younger = cache.insert([6], Blob(100))
    clock.now = 5.0
    cache.match([5])  # older: (1 + 1) * 1 / 200, the same score as younger's 1 / 100, but used later
    cache.insert([7], Blob(100))
    assert older in cache and younger not in cache


def test_stats() -> None:
    cache, _ = make(budget=100)
    cache.insert([1, 2], Blob(50), kind="prompt")
    cache.insert([1, 2, 3, 4], Blob(50), kind="message")
    cache.match([1, 2, 3, 4, 5])
    cache.match([1, 2, 3])
    cache.match([1, 2, 3, 4], max_len=3)
    cache.match([7])
    cache.match([1, 2], touch=False)
    cache.insert([9], Blob(30))
    s = cache.stats
    assert s == CacheStats(
        hits={"message": 1, "prompt": 2}, misses=1, insertions=3, evictions=1, bytes=80, entries=2
    )
    s.hits["prompt"] = 99
    assert cache.stats.hits["prompt"] == 2  # a snapshot
