"""A free sequence's kept state rolled back (``n_rs_seq``) for a prompt that parts from it near its end,
and the pool's bookkeeping of it."""

from __future__ import annotations

import pytest

from rsmem import Context
from rsmem.engine import Engine, SamplingParams
from rsmem.engine.pool import SequencePool
from rsmem.models import Mamba2Config, MambaConfig
from rsmem.models.mamba.random_init import random_mamba, random_mamba2

N_VOCAB = 64
GREEDY = SamplingParams.greedy(max_tokens=6)


def make_model(arch: str):
    if arch == "mamba":
        return random_mamba(MambaConfig(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8), seed=5)
    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=4)
    return random_mamba2(cfg, seed=3)


def run(engine: Engine, prompt: list[int]):
    rid = engine.add_request(prompt, GREEDY)
    return next(o for o in engine.run_until_done() if o.finished and o.request_id == rid)


def seq(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % N_VOCAB for k in range(n)]


@pytest.mark.parametrize(("arch", "compile_decode"), [("mamba", False), ("mamba2", False), ("mamba2", True)])
def test_a_turn_parting_near_the_end_of_the_kept_state_rolls_it_back(arch, compile_decode):
    model = make_model(arch)
    assert model.set_compile(compile_decode) == compile_decode
    ctx = Context(model, n_seq_max=1, n_batch=64, n_ubatch=16, n_rs_seq=4)
    engine = Engine(ctx, prompt_cache=True)
    prompt = seq(1, 20)
    first = run(engine, prompt).outputs[0].token_ids  # the sequence keeps prompt + first[:-1] (25 tokens)
    # the client re-sends the answer with its last two tokens re-tokenized, then a new message
    follow = prompt + list(first[:3]) + [(first[3] + 1) % N_VOCAB, 9] + seq(5, 6)
    out = run(engine, follow)
    assert out.num_cached_tokens == len(prompt) + 3  # cut 2 of 25 kept tokens, within n_rs_seq = 4
    assert engine.snapshot().cache_hits_rollback == 1
    expected = run(Engine(Context(model, n_seq_max=1, n_batch=64, n_ubatch=16)), follow)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_a_cut_deeper_than_n_rs_seq_recomputes_from_zero():
    model = make_model("mamba2")
    engine = Engine(Context(model, n_seq_max=1, n_batch=64, n_ubatch=16, n_rs_seq=2), prompt_cache=True)
    prompt = seq(1, 20)
    run(engine, prompt)  # keeps 25 tokens
    follow = [*prompt, 3, 4, 5]  # parts 5 tokens before the kept end: deeper than 2
    out = run(engine, follow)
    assert out.num_cached_tokens == 0
    snap = engine.snapshot()
    assert snap.cache_hits_rollback == 0 and snap.cache_misses == 2


class Trims:
    def __init__(self, ok: bool) -> None:
        self.ok, self.calls, self.cleared = ok, [], []

    def trim(self, seq: int, n: int) -> bool:
        self.calls.append((seq, n))
        return self.ok

    def clear(self, seq: int) -> None:
        self.cleared.append(seq)


def test_the_pool_prefers_the_sequence_serving_most_and_clears_when_the_trim_fails():
    mem = Trims(ok=False)
    pool = SequencePool(3, mem.clear, prompt_cache=True, trim=mem.trim, rollback_depth=3)
    for s, tokens in [(0, [1, 2, 3, 4, 5, 6]), (1, [1, 2, 3]), (2, [7, 8])]:
        pool.take(s, [])
        pool.release(s, tokens)
    prompt = [1, 2, 3, 4, 9, 9]
    assert pool.covered(0, prompt) == (4, True)  # cut 2 of 6
    assert pool.covered(1, prompt) == (3, False)  # an extension
    assert pool.covered(2, prompt) == (0, False)
    assert pool.best_free(prompt) == 0
    mem.cleared.clear()
    assert pool.take(0, prompt) == (0, False)  # the memory refused the cut: cleared, nothing reused
    assert mem.calls == [(0, 4)] and mem.cleared == [0]
    # the same prompt again is one token short of the kept tokens: at most len(prompt) - 1 is served
    assert pool.covered(1, [1, 2, 3]) == (2, True)
    assert SequencePool(1, mem.clear, prompt_cache=True).covered(0, prompt) == (0, False)


def test_slots_list_the_checkpoints_along_their_kept_tokens():
    model = make_model("mamba2")
    engine = Engine(
        Context(model, n_seq_max=2, n_batch=64, n_ubatch=16), prompt_cache=True, cache_bytes=1 << 24
    )
    prompt = seq(1, 20)
    run(engine, prompt)
    slot = next(s for s in engine.snapshot().slots if s.n_cached_tokens)
    assert slot.n_cached_tokens == len(prompt) + 5
    # the prompt minus its last token, and the whole kept state when the request ended
    assert slot.checkpoints == (len(prompt) - 1, len(prompt) + 5)
