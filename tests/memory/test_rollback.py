"""Rollback (``Context(..., n_rs_seq=K)``): ``seq_rm(s, p0, -1)`` removing at most the last K positions is
exact, whatever came before it (one-token decodes, a cut of the whole last batch, cuts in a row, forks,
restores, several sequences in one batch); deeper cuts return False and change nothing; K = 0 is the
plain recurrent memory. "Exact": decoding on from the cut gives the logits (f32, within 1e-5) and greedy
tokens of a fresh sequence fed the same tokens."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from helpers.memory import decode_seq, snapshot
from rsmem import Batch, Context
from rsmem.batch.allocator import BatchAllocator
from rsmem.errors import StateFormatError
from rsmem.memory.rollback import MIN_SPACING, RollbackHistory
from rsmem.models import DecayedSumModel
from rsmem.models.faulty import FaultyModel, InjectedFault
from rsmem.models.mamba.mamba1 import MambaConfig
from rsmem.models.mamba.mamba2 import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba, random_mamba2
from rsmem.models.step import compiled as compiled_mod

K = 6
VOCAB = 64
ARCHS = ["toy", "mamba", "mamba2"]
needs_cxx = pytest.mark.skipif(not compiled_mod.has_cxx_compiler(), reason="inductor needs a C++ compiler")
_MODELS: dict[str, object] = {}


def make_model(arch: str):
    if arch not in _MODELS:
        if arch == "toy":
            _MODELS[arch] = DecayedSumModel(n_vocab=VOCAB, n_embd=8, n_layer=2, seed=1)
        elif arch == "mamba":
            cfg = MambaConfig(d_model=32, n_layer=2, n_vocab=VOCAB, d_state=8, dt_rank=4)
            _MODELS[arch] = random_mamba(cfg, seed=3)
        else:
            cfg2 = Mamba2Config(
                d_model=32, n_layer=2, n_vocab=VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=4
            )
            _MODELS[arch] = random_mamba2(cfg2, seed=3)
        model = _MODELS[arch]
        if hasattr(model, "set_compile"):
            model.set_compile(False)
    return _MODELS[arch]


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def continue_like_fresh(ctx: Context, seq: int, tokens: list[int], rng: random.Random, n: int = 3) -> None:
    """Decode one random token, then ``n`` greedy ones, into ``seq``, and the same into a fresh context fed
    ``tokens`` (what ``seq`` holds); every step's logits and greedy token must agree. Extends ``tokens``."""
    ref = Context(ctx.model, n_seq_max=1)
    if tokens:
        ref.decode(Batch(list(tokens)))
    t = rng.randrange(VOCAB)
    for _ in range(n + 1):
        decode_seq(ctx, seq, [t])
        ref.decode(Batch([t]))
        got, want = ctx.get_logits(-1), ref.get_logits(-1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert int(got.argmax()) == int(want.argmax())
        tokens.append(t)
        t = int(got.argmax())
    ctx.memory.check_invariants()


def history_state(ctx: Context) -> dict[int, tuple[int, list[int], list[int]]]:
    rb = ctx.memory.rollback
    assert rb is not None
    out = {}
    for s in range(ctx.n_seq_max):
        h = rb.get(s)
        if h is not None:
            out[s] = (h.window, [(x.pos, x.rows) for x in h.snapshots], list(h.tokens))
    return out


def assert_histories_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for s in a:
        (wa, sa, ta), (wb, sb, tb) = a[s], b[s]
        assert (wa, ta) == (wb, tb)
        assert [p for p, _ in sa] == [p for p, _ in sb]
        assert all(x is y for (_, x), (_, y) in zip(sa, sb))


# ------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", range(3))
def test_random_decodes_and_cuts_match_fresh(arch: str, seed: int) -> None:
    rng = random.Random(seed * 31 + len(arch))
    ctx = Context(make_model(arch), n_seq_max=2, n_ubatch=rng.choice([5, 16, 512]), n_rs_seq=K)
    tokens = rand_tokens(rng, rng.randrange(1, 30))
    decode_seq(ctx, 0, tokens)
    for _ in range(6):
        for _ in range(rng.randrange(0, 3)):  # some batches, one token or several
            more = rand_tokens(rng, rng.choice([1, 1, 2, K - 1, K, K + 3]))
            decode_seq(ctx, 0, more)
            tokens += more
        window = ctx.memory.rollback.window(0)
        assert window == min(K, len(tokens)) or window <= K
        depth = rng.randrange(1, window + 1)
        p0 = len(tokens) - depth
        assert ctx.memory.seq_rm(0, p0, -1)
        del tokens[p0:]
        assert ctx.memory.seq_pos_max(0) == p0 - 1
        continue_like_fresh(ctx, 0, tokens, rng, n=2)


@pytest.mark.parametrize("arch", ["toy", "mamba2"])
@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_windows_and_states_exact(arch: str, seed: int) -> None:
    """Decodes of several sequences, cuts (in and beyond the window), forks, restores and removals in a
    random order; a plain Python model of the windows says which cuts succeed."""
    rng = random.Random(100 + seed)
    ctx = Context(make_model(arch), n_seq_max=3, n_ubatch=rng.choice([4, 512]), n_rs_seq=K)
    mem = ctx.memory
    tokens: dict[int, list[int]] = {}
    window: dict[int, int] = {}
    for _ in range(40):
        op = rng.choice(["decode", "decode", "cut", "cut", "cp", "restore", "rm"])
        s, d = rng.randrange(3), rng.randrange(3)
        if op == "decode":
            sizes = [1, 2, K + 2, K + MIN_SPACING - 1, K + MIN_SPACING + 3]
            step = {q: rand_tokens(rng, rng.choice(sizes)) for q in rng.sample(range(3), rng.randint(1, 3))}
            ctx.decode(Batch.from_sequences(step))
            for q, new in step.items():
                tokens.setdefault(q, []).extend(new)
                window[q] = min(K, window.get(q, 0) + len(new))
        elif op == "cut" and s in tokens and len(tokens[s]) > 1:
            depth = rng.randint(1, min(K + 2, len(tokens[s]) - 1))
            if depth <= window[s]:  # the replay is bounded
                target = len(tokens[s]) - depth - 1
                base = max(x.pos for x in mem.rollback.get(s).snapshots if x.pos <= target)
                assert target - base <= 2 * MIN_SPACING + K - 3
            assert mem.seq_rm(s, len(tokens[s]) - depth, -1) == (depth <= window[s])
            if depth <= window[s]:
                del tokens[s][-depth:]
                window[s] -= depth
        elif op == "cp" and s in tokens and s != d:
            mem.seq_cp(s, d)
            tokens[d], window[d] = list(tokens[s]), window[s]
        elif op == "restore" and s in tokens:
            ctx.state_seq_set_data(ctx.state_seq_get_data(s), d)
            tokens[d], window[d] = list(tokens[s]), 0
        elif op == "rm":
            mem.seq_rm(s, -1, -1)
            tokens.pop(s, None)
            window.pop(s, None)
        mem.check_invariants()
        assert {q: mem.rollback.window(q) for q in range(3)} == {q: window.get(q, 0) for q in range(3)}
    for q in sorted(tokens):
        continue_like_fresh(ctx, q, tokens[q], rng, n=1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("depth", [1, 3, K])
def test_cut_after_one_token_decodes(arch: str, depth: int) -> None:
    """llama.cpp's snapshot planes are stale here (one-token decodes after a multi-token batch)."""
    rng = random.Random(depth)
    ctx = Context(make_model(arch), n_rs_seq=K)
    tokens = rand_tokens(rng, 12)
    decode_seq(ctx, 0, tokens)
    for _ in range(2 * MIN_SPACING + 3):  # long enough for snapshots to be taken and dropped
        t = rand_tokens(rng, 1)
        decode_seq(ctx, 0, t)
        tokens += t
    assert ctx.memory.seq_rm(0, len(tokens) - depth, -1)
    del tokens[-depth:]
    continue_like_fresh(ctx, 0, tokens, rng)


@pytest.mark.parametrize("arch", ARCHS)
def test_cut_of_the_whole_last_batch(arch: str) -> None:
    rng = random.Random(5)
    ctx = Context(make_model(arch), n_ubatch=8, n_rs_seq=K)
    prompt = rand_tokens(rng, 25)
    decode_seq(ctx, 0, prompt)
    last = rand_tokens(rng, K)
    decode_seq(ctx, 0, last)
    assert ctx.memory.seq_rm(0, len(prompt), -1)  # exactly the last batch
    tokens = list(prompt)
    continue_like_fresh(ctx, 0, tokens, rng)
    short = rand_tokens(rng, K - 2)  # a shorter batch, cut with one token more than it
    decode_seq(ctx, 0, short)
    tokens += short
    assert ctx.memory.seq_rm(0, len(tokens) - len(short) - 1, -1)
    del tokens[len(tokens) - len(short) - 1 :]
    continue_like_fresh(ctx, 0, tokens, rng)


@pytest.mark.parametrize("arch", ARCHS)
def test_two_cuts_in_a_row(arch: str) -> None:
    rng = random.Random(7)
    ctx = Context(make_model(arch), n_rs_seq=K)
    tokens = rand_tokens(rng, 20)
    decode_seq(ctx, 0, tokens)
    assert ctx.memory.seq_rm(0, len(tokens) - 2, -1)
    assert ctx.memory.rollback.window(0) == K - 2
    assert ctx.memory.seq_rm(0, len(tokens) - K, -1)  # together: the whole window
    assert ctx.memory.rollback.window(0) == 0
    before = snapshot(ctx.memory)
    assert not ctx.memory.seq_rm(0, len(tokens) - K - 1, -1)  # nothing left to cut
    snapshot(ctx.memory).assert_same(before)
    del tokens[-K:]
    continue_like_fresh(ctx, 0, tokens, rng)


@pytest.mark.parametrize("arch", ARCHS)
def test_cut_after_fork(arch: str) -> None:
    rng = random.Random(11)
    ctx = Context(make_model(arch), n_seq_max=3, n_rs_seq=K)
    tokens = rand_tokens(rng, 15)
    decode_seq(ctx, 0, tokens)
    ctx.memory.seq_cp(0, 1)  # 1 shares 0's cell
    assert ctx.memory.seq_rm(1, len(tokens) - 4, -1)
    assert ctx.memory.cells.tail[0] != ctx.memory.cells.tail[1]
    forked = tokens[:-4]
    continue_like_fresh(ctx, 0, tokens, rng)  # the source is untouched
    continue_like_fresh(ctx, 1, forked, rng)
    ctx.memory.seq_cp(1, 2)
    assert ctx.memory.seq_rm(2, len(forked) - 2, -1)  # a fork's own window came with it
    continue_like_fresh(ctx, 2, forked[:-2], rng)
    continue_like_fresh(ctx, 1, forked, rng)


@pytest.mark.parametrize("arch", ARCHS)
def test_several_sequences_in_one_batch(arch: str) -> None:
    rng = random.Random(13)
    ctx = Context(make_model(arch), n_seq_max=4, n_ubatch=16, n_rs_seq=K)
    seqs = {s: rand_tokens(rng, n) for s, n in enumerate([3, 9, 20, 40])}
    ctx.decode(Batch.from_sequences(seqs))
    for _ in range(4):  # joint one-token steps
        step = {s: rand_tokens(rng, 1) for s in seqs}
        ctx.decode(Batch.from_sequences(step))
        for s in seqs:
            seqs[s] += step[s]
    for s, depth in zip(seqs, [1, 3, K, 2]):
        assert ctx.memory.seq_rm(s, len(seqs[s]) - depth, -1)
        del seqs[s][-depth:]
    nxt = {s: rand_tokens(rng, 1) for s in seqs}
    ctx.decode(Batch.from_sequences(nxt, all_logits=True))
    for i, s in enumerate(seqs):
        ref = Context(ctx.model)
        ref.decode(Batch(seqs[s] + nxt[s]))
        torch.testing.assert_close(ctx.logits[i], ref.get_logits(-1), rtol=0, atol=1e-5)
    ctx.memory.check_invariants()


@pytest.mark.parametrize("arch", ARCHS)
def test_cut_after_restore(arch: str) -> None:
    rng = random.Random(17)
    ctx = Context(make_model(arch), n_seq_max=2, n_rs_seq=K)
    tokens = rand_tokens(rng, 14)
    decode_seq(ctx, 0, tokens)
    ctx.state_seq_set_data(ctx.state_seq_get_data(0), 1)
    assert ctx.memory.rollback.window(1) == 0  # the history is not part of the state
    assert not ctx.memory.seq_rm(1, len(tokens) - 1, -1)
    more = rand_tokens(rng, 3)
    decode_seq(ctx, 1, more)
    assert ctx.memory.seq_rm(1, len(tokens) + 1, -1)  # back into what was decoded since the restore
    restored = tokens + more[:1]
    continue_like_fresh(ctx, 1, restored, rng)
    assert not ctx.memory.seq_rm(1, len(tokens) - 1, -1)  # before the restore: not in the window


@pytest.mark.parametrize("arch", ARCHS)
def test_state_file_after_cut_is_the_cut_state(arch: str, tmp_path) -> None:
    rng = random.Random(19)
    ctx = Context(make_model(arch), n_rs_seq=K)
    tokens = rand_tokens(rng, 16)
    decode_seq(ctx, 0, tokens)
    assert ctx.memory.seq_rm(0, 12, -1)
    ctx.state_seq_save_file(tmp_path / "s.ggsq", 0, tokens[:12])
    plain = Context(ctx.model)
    assert plain.state_seq_load_file(tmp_path / "s.ggsq", 0) == tokens[:12]
    continue_like_fresh(plain, 0, tokens[:12], rng)


# ------------------------------------------------------------------------------- refusals, failures


@pytest.mark.parametrize("arch", ARCHS)
def test_cut_deeper_than_the_window_changes_nothing(arch: str) -> None:
    rng = random.Random(23)
    ctx = Context(make_model(arch), n_seq_max=2, n_rs_seq=K)
    tokens = rand_tokens(rng, 30)
    decode_seq(ctx, 0, tokens)
    decode_seq(ctx, 1, tokens[:3])
    assert ctx.memory.seq_rm(0, 28, -1)  # window K - 2 left
    mem_before, hist_before = snapshot(ctx.memory), history_state(ctx)
    for p0, p1 in ((28 - K + 2 - 1, -1), (28 - K - 5, -1), (1, -1), (3, 40)):
        assert not ctx.memory.seq_rm(0, p0, p1)
        snapshot(ctx.memory).assert_same(mem_before)
        assert_histories_equal(history_state(ctx), hist_before)
    assert ctx.memory.seq_rm(0, 5, 20)  # a range ending before the state's position: a no-op
    snapshot(ctx.memory).assert_same(mem_before)
    assert_histories_equal(history_state(ctx), hist_before)
    assert ctx.memory.seq_rm(0, 0, -1)  # from position 0: the ordinary removal
    assert ctx.memory.rollback.get(0) is None and ctx.memory.rollback.get(1) is not None


def test_a_failed_replay_changes_nothing() -> None:
    model = FaultyModel(make_model("toy"))
    ctx = Context(model, n_seq_max=2, n_rs_seq=K)
    rng = random.Random(29)
    tokens = rand_tokens(rng, 2 * MIN_SPACING + 5)
    decode_seq(ctx, 0, tokens)
    ctx.memory.seq_cp(0, 1)
    mem_before, hist_before = snapshot(ctx.memory), history_state(ctx)
    model.raise_when(lambda seqs: True, after_layers=1)  # fails half way through the replay's layers
    with pytest.raises(InjectedFault):
        ctx.memory.seq_rm(1, len(tokens) - 3, -1)
    snapshot(ctx.memory).assert_same(mem_before)
    assert_histories_equal(history_state(ctx), hist_before)
    model.raise_when(None)
    assert ctx.memory.seq_rm(1, len(tokens) - 3, -1)
    continue_like_fresh(ctx, 1, tokens[:-3], rng)


def test_a_failed_restore_keeps_the_history() -> None:
    ctx = Context(make_model("toy"), n_rs_seq=K)
    decode_seq(ctx, 0, list(range(10)))
    before = history_state(ctx)
    with pytest.raises(StateFormatError):
        ctx.state_seq_set_data(ctx.state_seq_get_data(0)[:-3], 0)
    assert_histories_equal(history_state(ctx), before)
    assert ctx.memory.seq_rm(0, 7, -1)


def test_without_a_model_no_cut_succeeds() -> None:
    ctx = Context(make_model("toy"), n_rs_seq=K)
    decode_seq(ctx, 0, list(range(10)))
    ctx.memory.rollback.bind(None, 1)  # type: ignore[arg-type]
    before = snapshot(ctx.memory)
    assert not ctx.memory.seq_rm(0, 8, -1)
    snapshot(ctx.memory).assert_same(before)


# ------------------------------------------------------------------------------ K = 0, other ops


def test_k0_is_the_plain_memory() -> None:
    model = make_model("toy")
    ctx = Context(model)
    assert ctx.n_rs_seq == 0 and ctx.memory.rollback is None
    decode_seq(ctx, 0, list(range(12)))
    before = snapshot(ctx.memory)
    assert not ctx.memory.seq_rm(0, 11, -1)  # llama.cpp's answer for a recurrent memory
    snapshot(ctx.memory).assert_same(before)
    with pytest.raises(ValueError, match="n_rs_seq"):
        Context(model, n_rs_seq=-1)


def test_state_files_do_not_carry_the_history() -> None:
    """With batches of at most K tokens a K > 0 context computes exactly what K = 0 does, and saves the
    same bytes: the history is never written."""
    model = make_model("mamba")
    plain, rolling = Context(model, n_seq_max=2), Context(model, n_seq_max=2, n_rs_seq=K)
    rng = random.Random(31)
    for _ in range(5):
        step = {0: rand_tokens(rng, K), 1: rand_tokens(rng, 2)}
        plain.decode(Batch.from_sequences(step))
        rolling.decode(Batch.from_sequences(step))
    assert rolling.state_get_data() == plain.state_get_data()
    assert rolling.state_seq_get_data(1) == plain.state_seq_get_data(1)
    plain.state_set_data(rolling.state_get_data())


def test_split_keeps_each_sequence_tail_apart() -> None:
    balloc = BatchAllocator()
    batch = Batch.from_sequences({0: list(range(20)), 1: list(range(5)), 2: list(range(9))})
    balloc.init(batch, n_vocab=32, n_seq_max=3)

    def ends(*tail: int) -> dict[int, list[int]]:
        balloc.split_reset()
        out: dict[int, list[int]] = {0: [], 1: [], 2: []}
        while (ub := balloc.split_equal(8, False, *tail)) is not None:
            for s in range(ub.n_seqs):
                out[ub.seq_set(s)[0]].append(ub.last_pos(s))
        assert balloc.n_used == balloc.n_tokens
        return out

    with_tail = ends(4)
    for seq, n in ((0, 20), (1, 5), (2, 9)):
        assert n - 1 - 4 in with_tail[seq]  # a micro-batch ends 4 tokens before the last
    with_tail = ends(4, 6)  # only sets with 6 tokens or more before their last 4 are split
    assert 15 in with_tail[0] and with_tail[1] == ends()[1] and with_tail[2] == ends()[2]
    assert ends(0) == ends() == {0: [1, 3, 4, 8, 16, 19], 1: [1, 3, 4], 2: [1, 3, 4, 8]}


class CountingModel(DecayedSumModel):
    def __init__(self) -> None:
        super().__init__(n_vocab=VOCAB, n_embd=8, n_layer=2, seed=1)
        self.shapes: list[tuple[int, int]] = []

    def forward(self, ubatch, states):
        self.shapes.append((ubatch.n_seqs, ubatch.n_seq_tokens))
        return super().forward(ubatch, states)


def test_only_long_batches_end_a_micro_batch_before_their_tail() -> None:
    model = CountingModel()
    ctx = Context(model, n_rs_seq=K)
    decode_seq(ctx, 0, list(range(K + MIN_SPACING)))  # a prompt: split where the window's floor falls
    assert model.shapes == [(1, MIN_SPACING), (1, K)]
    model.shapes.clear()
    decode_seq(ctx, 0, list(range(K + 1)))  # a speculative draft's check: one micro-batch
    decode_seq(ctx, 0, list(range(K + MIN_SPACING - 1)))
    assert model.shapes == [(1, K + 1), (1, K + MIN_SPACING - 1)]


def test_history_is_bounded_and_snapshots_sparse() -> None:
    ctx = Context(make_model("toy"), n_ubatch=16, n_rs_seq=K)
    rng = random.Random(37)
    decode_seq(ctx, 0, rand_tokens(rng, 100))  # a long prefill: a snapshot right at the window's floor
    h = ctx.memory.rollback.get(0)
    assert [s.pos for s in h.snapshots] == [99 - K] and len(h.tokens) == K
    taken = set()
    for _ in range(5 * MIN_SPACING):
        decode_seq(ctx, 0, rand_tokens(rng, 1))
        h = ctx.memory.rollback.get(0)
        taken.update(s.pos for s in h.snapshots)
        assert len(h.snapshots) <= 2 and len(h.tokens) < MIN_SPACING + 2 * K
    assert len(taken) <= 1 + 5  # one whole-state copy per MIN_SPACING tokens
    per_seq = ctx.memory.state_bytes_per_seq()
    assert ctx.memory.rollback.nbytes() <= 2 * per_seq + 8 * (MIN_SPACING + 2 * K)


def replay_length(ctx: Context, seq: int, p0: int) -> int:
    snaps = ctx.memory.rollback.get(seq).snapshots
    return p0 - 1 - max(x.pos for x in snaps if x.pos <= p0 - 1)


def test_replays_stay_bounded_after_long_cuts() -> None:
    """Batches just too short to be split leave long replays; a cut that replays many tokens keeps its
    result as a snapshot, so the next replay does not grow."""
    rng = random.Random(43)
    ctx = Context(make_model("toy"), n_rs_seq=K)
    tokens = rand_tokens(rng, MIN_SPACING + 9)
    decode_seq(ctx, 0, tokens)
    bound = 2 * MIN_SPACING + K - 3
    for _ in range(3):
        more = rand_tokens(rng, K + MIN_SPACING - 1)  # not split
        decode_seq(ctx, 0, more)
        tokens += more
        p0 = len(tokens) - K
        assert replay_length(ctx, 0, p0) <= bound
        assert ctx.memory.seq_rm(0, p0, -1)
        del tokens[p0:]
        ctx.memory.check_invariants()
    continue_like_fresh(ctx, 0, tokens, rng)


def test_seq_add_moves_the_history_and_seq_div_drops_it() -> None:
    rng = random.Random(41)
    ctx = Context(make_model("toy"), n_rs_seq=K)
    tokens = rand_tokens(rng, 10)
    decode_seq(ctx, 0, tokens)
    ctx.memory.seq_add(0, 0, -1, 5)
    assert ctx.memory.seq_pos_max(0) == 14
    assert ctx.memory.seq_rm(0, 13, -1)  # positions 13, 14: the last two tokens
    ref = Context(ctx.model)
    ref.decode(Batch([*tokens[:-2], 1]))
    decode_seq(ctx, 0, [1])
    torch.testing.assert_close(ctx.get_logits(-1), ref.get_logits(-1), rtol=0, atol=1e-5)
    ctx.memory.seq_div(0, 0, -1, 2)
    assert ctx.memory.rollback.get(0) is None
    assert not ctx.memory.seq_rm(0, ctx.memory.seq_pos_max(0), -1)
    ctx.memory.check_invariants()


def test_rollback_history_needs_a_positive_k() -> None:
    with pytest.raises(ValueError):
        RollbackHistory(Context(make_model("toy")).memory, 0)


# ---------------------------------------------------------------------------------------- compiled


@pytest.mark.compiled
@needs_cxx
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_compiled_steps_roll_back_exactly(arch: str) -> None:
    model = make_model(arch)
    rng = random.Random(43)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a compile failure would fall back silently
            model.set_compile(True)
            ctx = Context(model, n_rs_seq=K)
            tokens = rand_tokens(rng, 10)
            decode_seq(ctx, 0, tokens)
            for _ in range(8):
                t = rand_tokens(rng, 1)
                decode_seq(ctx, 0, t)
                tokens += t
            assert ctx.memory.seq_rm(0, len(tokens) - 4, -1)
            del tokens[-4:]
            continue_like_fresh(ctx, 0, tokens, rng)
    finally:
        model.set_compile(False)
