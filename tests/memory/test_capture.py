"""Checkpoints captured inside a micro-batch (``Context.decode(batch, capture=...)``): each equals the
checkpoint of a fresh sequence fed exactly the prefix, restores into a sequence that continues as a fresh
one, in every codec; a decode that raises captures nothing. The kernels' states at points against their
token-by-token twins.

Captured states are not bit-for-bit those of a fresh prefix: the projections of a micro-batch of L rows
round differently from those of n rows (a capture at a micro-batch's last token is the cell's own copy,
bit-exact). f32 states agree within 1e-5.
"""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path

import pytest
import torch

from rsmem import Batch, Context
from rsmem.memory import checkpoint
from rsmem.memory.capture import accepts_capture
from rsmem.memory.checkpoint import Checkpoint
from rsmem.models import DecayedSumModel, Mamba2Config, Mamba2Model, MambaConfig
from rsmem.models.faulty import FaultyModel, InjectedFault
from rsmem.models.mamba.random_init import random_mamba, random_mamba2
from rsmem.models.ops.conv import conv_windows_at, conv_windows_at_ref
from rsmem.models.ops.selective_scan import selective_scan_, selective_scan_at_, selective_states_at_ref
from rsmem.models.ops.ssd import ssd_chunked_, ssd_chunked_at_, ssd_states_at_ref
from rsmem.models.step import compiled, fused

N_VOCAB = 64
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
ATOL = 1e-5
COMPILE = [
    False,
    pytest.param(
        True,
        marks=[pytest.mark.compiled, pytest.mark.skipif(not compiled.has_cxx_compiler(), reason="no C++")],
    ),
]


@functools.cache
def _model(arch: str):
    if arch == "mamba":
        return random_mamba(MambaConfig(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, dt_rank=4), 3)
    if arch == "mamba2":
        cfg = Mamba2Config(
            d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=8
        )
        return random_mamba2(cfg, seed=3)
    return DecayedSumModel(n_vocab=N_VOCAB, n_embd=6, n_layer=3, seed=1)


def model(arch: str, compile_decode: bool = False):
    m = _model(arch)
    if arch != "toy":
        m.set_compile(compile_decode)
        assert m.compile_decode == compile_decode
    return m


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(N_VOCAB) for _ in range(n)]


def fresh(m, prefix: list[int], codec: str = "exact") -> Checkpoint:
    """The checkpoint of a fresh sequence fed exactly ``prefix`` in one batch."""
    ctx = Context(m, n_seq_max=1, n_batch=256, n_ubatch=256)
    ctx.decode(Batch(prefix, seq_ids=[[0]] * len(prefix)))
    ckpt = checkpoint.take(ctx.memory, 0, codec)
    assert ckpt is not None
    return ckpt


def assert_same_state(got: Checkpoint, want: Checkpoint, atol: float = ATOL) -> None:
    assert got.pos == want.pos and got.codec == want.codec
    for a, b in zip((*got.r_rows, *got.s_rows), (*want.r_rows, *want.s_rows), strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.shape == b.shape and a.dtype == b.dtype and a.data.dtype == b.data.dtype
            torch.testing.assert_close(checkpoint._decode(a), checkpoint._decode(b), rtol=0, atol=atol)


def greedy(ctx: Context, seq: int, first: int, n: int) -> tuple[list[int], torch.Tensor]:
    """Feed ``first`` then n - 1 greedy tokens into ``seq``; the tokens fed and each step's logits."""
    out, logits, t = [], [], first
    for _ in range(n):
        ctx.decode(Batch([t], seq_ids=[[seq]]))
        out.append(t)
        logits.append(ctx.get_logits(-1).clone())
        t = int(logits[-1].argmax())
    return out, torch.stack(logits)


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("compile_decode", COMPILE)
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_captures_equal_fresh_prefixes(arch: str, compile_decode: bool) -> None:
    """(a) Random prompts, a random part of each already in the sequence, random capture points (chunk
    ends, inside chunks, the first and the last token): each equals a fresh prefix's checkpoint."""
    m = model(arch, compile_decode)
    rng = random.Random(f"{arch}{compile_decode}")
    for _ in range(3):
        prompt = tokens(rng.randrange(2, 41), rng)
        done = rng.randrange(0, len(prompt) - 1)  # tokens decoded before the capturing batch
        wanted = sorted(rng.sample(range(1, len(prompt) + 1), k=min(6, len(prompt))))
        ctx = Context(m, n_seq_max=2, n_batch=256, n_ubatch=256)
        if done:
            ctx.decode(Batch(prompt[:done], seq_ids=[[0]] * done))
        rest = prompt[done:]
        ctx.decode(Batch(rest, seq_ids=[[0]] * len(rest)), capture={0: wanted, 1: [3]})
        got = ctx.captured()
        assert set(got) == {(0, n) for n in wanted if n > done}  # others were not in the batch
        for (_, n), ckpt in got.items():
            assert_same_state(ckpt, fresh(m, prompt[:n]))
            # ordinary tensors, as take() outside a decode gives: a cache may hold and write them freely
            assert not any(e.data.is_inference() for e in ckpt.s_rows if e is not None)
        if (0, len(prompt)) in got:  # the last token: the cell's own state, bit for bit
            want = checkpoint.take(ctx.memory, 0)
            assert want is not None
            assert all(torch.equal(a.data, b.data) for a, b in zip(got[0, len(prompt)].s_rows, want.s_rows))
        ctx.memory.check_invariants()


@pytest.mark.parametrize("compile_decode", COMPILE)
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_captures_change_nothing_else(arch: str, compile_decode: bool) -> None:
    """A decode with captures leaves every logit and state bit for bit as the same decode without."""
    m = model(arch, compile_decode)
    rng = random.Random(1)
    batch = Batch.from_sequences({0: tokens(21, rng), 1: tokens(21, rng)}, all_logits=True)
    runs = []
    for capture in (None, {0: [3, 8, 17], 1: [1, 16, 21]}):
        ctx = Context(m, n_seq_max=2, n_batch=64, n_ubatch=64)
        ctx.decode(batch, capture=capture)
        runs.append([ctx.logits, *(t for t in (*ctx.memory.r_l, *ctx.memory.s_l) if t is not None)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("compile_decode", COMPILE)
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_restored_capture_generates_as_a_fresh_sequence(arch: str, compile_decode: bool) -> None:
    """(b) A capture restored into another sequence generates greedily the tokens, and within 1e-5 the
    logits, of a fresh sequence fed the same tokens."""
    m = model(arch, compile_decode)
    rng = random.Random(7)
    prompt = tokens(30, rng)
    cut = 13
    ctx = Context(m, n_seq_max=3, n_batch=64, n_ubatch=64)
    ctx.decode(Batch(prompt, seq_ids=[[0]] * 30), capture={0: [cut]})
    checkpoint.restore(ctx.memory, ctx.captured()[0, cut], 2)
    assert ctx.memory.seq_pos_max(2) == cut - 1
    got_tokens, got_logits = greedy(ctx, 2, prompt[cut], 6)
    ref = Context(m, n_seq_max=1, n_batch=64, n_ubatch=64)
    ref.decode(Batch(prompt[:cut], seq_ids=[[0]] * cut))
    want_tokens, want_logits = greedy(ref, 0, prompt[cut], 6)
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=ATOL)
    ctx.memory.check_invariants()


@pytest.mark.parametrize("compile_decode", COMPILE)
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
@pytest.mark.parametrize("n_ubatch", [64, 5])
def test_several_sequences_and_small_micro_batches(arch: str, compile_decode: bool, n_ubatch: int) -> None:
    """(c, d) Sequences of one batch with their own points; with n_ubatch = 5 the points fall in different
    micro-batches, at their ends and inside them."""
    m = model(arch, compile_decode)
    rng = random.Random(n_ubatch)
    prompts = {0: tokens(17, rng), 1: tokens(17, rng), 3: tokens(9, rng)}
    wanted = {0: [1, 5, 6, 12, 17], 1: [2, 10, 16], 3: [4, 8, 9], 2: [1]}
    ctx = Context(m, n_seq_max=4, n_batch=64, n_ubatch=n_ubatch)
    ctx.decode(Batch.from_sequences(prompts), capture=wanted)
    got = ctx.captured()
    assert set(got) == {(s, n) for s, ns in wanted.items() if s in prompts for n in ns}
    for (s, n), ckpt in got.items():
        assert_same_state(ckpt, fresh(m, prompts[s][:n]))


@pytest.mark.compiled
def test_one_token_micro_batches_capture_the_state_after_them() -> None:
    """3. One-token decodes (the compiled step with compile on): the capture is the cell's state."""
    m = model("mamba2", compiled.has_cxx_compiler())
    ctx = Context(m, n_seq_max=2)
    ctx.decode(Batch([1, 2, 3], seq_ids=[[0]] * 3))
    for k, t in enumerate([4, 5, 6]):
        ctx.decode(Batch([t], seq_ids=[[0]]), capture={0: [4 + k]})
        want = checkpoint.take(ctx.memory, 0)
        got = ctx.captured()[0, 4 + k]
        assert want is not None and got.pos == want.pos == 3 + k
        assert all(torch.equal(a.data, b.data) for a, b in zip(got.s_rows, want.s_rows) if a and b)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_lossy_codecs_stay_within_the_checkpoint_bound(codec: str) -> None:
    """(e) A bf16 / int8 capture is the codec of the exact state: restored, 8 further tokens stay within 5%
    of the logit scale (the bound of tests/memory/test_checkpoint.py), and it is as small as ``take``'s."""
    m = model("mamba2")
    rng = random.Random(11)
    prompt, more = tokens(24, rng), tokens(8, rng)
    ctx = Context(m, n_seq_max=2, n_batch=64, n_ubatch=64)
    ctx.decode(Batch(prompt, seq_ids=[[0]] * 24), capture={0: [10]}, capture_codec=codec)
    lossy = ctx.captured()[0, 10]
    want = fresh(m, prompt[:10], codec)
    assert lossy.codec == codec and lossy.nbytes == want.nbytes
    checkpoint.restore(ctx.memory, lossy, 1)
    ref = Context(m, n_seq_max=1, n_batch=64, n_ubatch=64)
    ref.decode(Batch(prompt[:10], seq_ids=[[0]] * 10))
    expected = torch.stack([greedy(ref, 0, t, 1)[1][0] for t in more])
    got = torch.stack([greedy(ctx, 1, t, 1)[1][0] for t in more])
    assert float((expected - got).abs().max() / expected.abs().max()) < 0.05


def test_an_unknown_codec_is_refused_before_anything_runs() -> None:
    ctx = Context(model("mamba2"), n_seq_max=1)
    with pytest.raises(ValueError, match="codec"):
        ctx.decode(Batch([1, 2, 3]), capture={0: [2]}, capture_codec="fp4")
    assert ctx.memory.seq_pos_max(0) == -1


def test_a_hybrid_memory_refuses_captures_unchanged() -> None:
    import rsmem

    ctx = Context(rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf"), n_seq_max=1, n_ctx=64)
    with pytest.raises(ValueError, match="recurrent memory"):
        ctx.decode(Batch([1, 2, 3]), capture={0: [2]})
    assert ctx.memory.seq_pos_max(0) == -1
    ctx.decode(Batch([1, 2, 3]), capture={})  # no capture asked: decodes as ever
    assert ctx.memory.seq_pos_max(0) == 2


@pytest.mark.parametrize("after_layers", [0, 1])
def test_a_decode_that_raises_captures_nothing(after_layers: int) -> None:
    """(f) A decode that raises (before any state or after a layer was written) leaves no captures, even
    from its micro-batches that succeeded."""
    faulty = FaultyModel(model("mamba2"))
    ctx = Context(faulty, n_seq_max=2, n_batch=64, n_ubatch=4)
    ctx.decode(Batch([1, 2, 3, 4, 5, 6]), capture={0: [2]})
    assert set(ctx.captured()) == {(0, 2)}
    faulty.raise_when(lambda seqs: 1 in seqs, after_layers=after_layers)
    batch = Batch.from_sequences({0: [7, 8, 9, 10, 11, 12], 1: [1, 2, 3, 4, 5, 6]})
    with pytest.raises(InjectedFault):
        ctx.decode(batch, capture={0: [8, 10], 1: [2, 5]})
    assert ctx.captured() == {}


# --------------------------------------------------------------- models without in-pass capture


class _Logged(Mamba2Model):
    """A subclass whose own forward drops ``capture``: it must get slices, not a capture it ignores."""

    def forward(self, ubatch, states):  # type: ignore[no-untyped-def, override]
        return super().forward(ubatch, states)


@pytest.mark.parametrize("arch", ["toy", "faulty", "rwkv7", "subclass"])
def test_other_models_capture_by_running_slices(arch: str) -> None:
    """A model whose forward cannot capture (the toy, a wrapper, RWKV-7, a subclass whose forward takes no
    ``capture``) gets its micro-batch as slices ending at the points: the same checkpoints, the same
    logits as one pass."""
    if arch == "rwkv7":
        import rsmem

        m = rsmem.load_model(FIXTURES / "rwkv" / "rwkv7" / "model-f32.gguf")
    elif arch == "subclass":
        m = copy.copy(model("mamba2"))
        m.__class__ = _Logged
        assert not accepts_capture(m) and accepts_capture(model("mamba2"))
    else:
        m = FaultyModel(model("mamba")) if arch == "faulty" else model("toy")
    rng = random.Random(3)
    prompts = {0: tokens(12, rng), 1: tokens(12, rng)}
    ctx = Context(m, n_seq_max=2, n_batch=64, n_ubatch=64)
    batch = Batch.from_sequences(prompts, all_logits=True)
    ctx.decode(batch, capture={0: [3, 7], 1: [7, 12]})
    got, logits = ctx.captured(), ctx.logits.clone()
    plain = Context(m, n_seq_max=2, n_batch=64, n_ubatch=64)
    plain.decode(batch)
    torch.testing.assert_close(logits, plain.logits, rtol=1e-5, atol=ATOL)
    assert set(got) == {(0, 3), (0, 7), (1, 7), (1, 12)}
    # the toy's states grow with the prompt: its bound is relative
    biggest = max(float(t.abs().max()) for t in ctx.memory.s_l if t is not None)
    atol = max(ATOL, 1e-6 * biggest) if arch == "toy" else ATOL
    for (s, n), ckpt in got.items():
        assert_same_state(ckpt, fresh(m, prompts[s][:n]), atol=atol)


# ------------------------------------------------------------------------------- memory dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_memories_capture_in_their_dtype(dtype: torch.dtype) -> None:
    """Rows of a bf16/f16 memory are captured in its dtype, rounded once from the f32 pass (as a fresh
    prefix's last micro-batch rounds them): within one rounding of the fresh prefix's state."""
    m = model("mamba2")
    rng = random.Random(5)
    prompt = tokens(20, rng)
    ctx = Context(m, n_seq_max=1, n_batch=64, n_ubatch=64, state_dtype=dtype)
    ctx.decode(Batch(prompt, seq_ids=[[0]] * 20), capture={0: [6, 11]})
    for n in (6, 11):
        ref = Context(m, n_seq_max=1, n_batch=64, n_ubatch=64, state_dtype=dtype)
        ref.decode(Batch(prompt[:n], seq_ids=[[0]] * n))
        want = checkpoint.take(ref.memory, 0)
        got = ctx.captured()[0, n]
        assert want is not None and got.pos == want.pos
        for a, b in zip(got.s_rows, want.s_rows, strict=True):
            assert a is not None and b is not None and a.data.dtype == dtype
            torch.testing.assert_close(a.data.float(), b.data.float(), rtol=1e-2, atol=1e-4)


# ------------------------------------------------------------------------------------------ kernels


def _points(rng: random.Random, n_seqs: int, n_tokens: int) -> list[tuple[int, int]]:
    return sorted({(rng.randrange(n_seqs), rng.randrange(n_tokens)) for _ in range(6)})


@pytest.mark.parametrize("n_tokens", [1, 2, 9, 24])
def test_conv_windows_at_match_the_token_loop(n_tokens: int) -> None:
    g = torch.Generator().manual_seed(n_tokens)
    window, x = torch.randn(2, 6, 3, generator=g), torch.randn(2, n_tokens, 6, generator=g)
    at = _points(random.Random(n_tokens), 2, n_tokens)
    assert torch.equal(conv_windows_at(window, x, at), conv_windows_at_ref(window, x, at))


def _ssd_inputs(n_seqs: int, n_tokens: int, g: torch.Generator):
    h_, p, n, n_group = 4, 3, 5, 2
    x = torch.randn(n_seqs, n_tokens, h_, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(n_seqs, n_tokens, h_, generator=g))
    A = -torch.exp(torch.randn(h_, generator=g))
    B = torch.randn(n_seqs, n_tokens, n_group, n, generator=g)
    C = torch.randn(n_seqs, n_tokens, n_group, n, generator=g)
    D, h = torch.randn(h_, generator=g), torch.randn(n_seqs, h_, p, n, generator=g)
    return x, dt, A, B, C, D, h


@pytest.mark.parametrize(("n_tokens", "chunk"), [(1, 4), (9, 4), (16, 4), (23, 8), (7, 64)])
def test_ssd_states_at_match_the_token_loop(n_tokens: int, chunk: int) -> None:
    """Points at chunk ends, inside chunks and in a padded last chunk; y and h as without points."""
    x, dt, A, B, C, D, h = _ssd_inputs(3, n_tokens, torch.Generator().manual_seed(n_tokens))
    at = [*_points(random.Random(n_tokens), 3, n_tokens), (1, n_tokens - 1), (0, min(chunk, n_tokens) - 1)]
    h_plain, h_at = h.clone(), h.clone()
    y_plain = ssd_chunked_(x, dt, A, B, C, D, h_plain, chunk_size=chunk)
    y, states = ssd_chunked_at_(x, dt, A, B, C, D, h_at, at, chunk_size=chunk)
    assert torch.equal(y, y_plain) and torch.equal(h_at, h_plain)
    torch.testing.assert_close(states, ssd_states_at_ref(x, dt, A, B, C, D, h, at), rtol=1e-5, atol=1e-5)


def _mamba_inputs(n_seqs: int, n_tokens: int, g: torch.Generator, dt_scale: float):
    d, n = 12, 5
    x = torch.randn(n_seqs, n_tokens, d, generator=g)
    dt = torch.rand(n_seqs, n_tokens, d, generator=g) * dt_scale
    A = -torch.rand(d, n, generator=g) * 16
    B, C = torch.randn(n_seqs, n_tokens, n, generator=g), torch.randn(n_seqs, n_tokens, n, generator=g)
    D, h = torch.randn(d, generator=g), torch.randn(n_seqs, d, n, generator=g)
    return x, dt, A, B, C, D, h


@pytest.mark.parametrize(("n_tokens", "dt_scale"), [(1, 1.0), (11, 0.1), (40, 3.0)])
def test_selective_scan_states_at_match_the_token_loop(n_tokens: int, dt_scale: float) -> None:
    """The chunked scan (chunks cut short by strong decay) and the blocked scan (eager blocks, cut at the
    points): states at points as the token loop's; y and h as without points."""
    g = torch.Generator().manual_seed(n_tokens)
    x, dt, A, B, C, D, h = _mamba_inputs(2, n_tokens, g, dt_scale)
    at = [*_points(random.Random(n_tokens), 2, n_tokens), (0, n_tokens - 1)]
    want = selective_states_at_ref(x, dt, A, B, C, D, h, at)
    h_plain, h_at = h.clone(), h.clone()
    y_plain = selective_scan_(x, dt, A, B, C, D, h_plain, max_chunk=8)
    y, states = selective_scan_at_(x, dt, A, B, C, D, h_at, at, max_chunk=8)
    assert torch.equal(y, y_plain) and torch.equal(h_at, h_plain)
    torch.testing.assert_close(states, want, rtol=1e-4, atol=1e-4)
    h_plain, h_at = h.clone(), h.clone()
    y_plain = fused.selective_scan_blocked_(x, dt, A, B, C, D, h_plain)
    y, states = fused.selective_scan_blocked_at_(x, dt, A, B, C, D, h_at, at)
    torch.testing.assert_close(y, y_plain, rtol=0, atol=1e-6)  # blocks cut at the points: same steps
    assert torch.equal(h_at, h_plain)
    torch.testing.assert_close(states, want, rtol=1e-5, atol=1e-5)
