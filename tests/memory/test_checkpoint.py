"""Checkpoints: a restored state continues exactly as the original (exact codec), or within the codec's
bound (bf16, int8); a restore that cannot happen changes nothing."""

from __future__ import annotations

import pytest
import torch

from helpers.memory import snapshot
from rsmem import Batch, Context
from rsmem.memory import checkpoint
from rsmem.models import DecayedSumModel, Mamba2Config, MambaConfig
from rsmem.models.mamba.random_init import random_mamba, random_mamba2

N_VOCAB = 64


def models():
    return {
        "toy": DecayedSumModel(n_vocab=N_VOCAB, n_embd=6, n_layer=3, seed=1),
        "mamba": random_mamba(MambaConfig(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, dt_rank=4), 3),
        "mamba2": random_mamba2(
            Mamba2Config(
                d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=4
            ),
            seed=3,
        ),
    }


def feed(ctx: Context, seq: int, tokens: list[int]) -> torch.Tensor:
    """Decode ``tokens`` into ``seq`` one at a time (as generation does); the logits of each."""
    out = []
    for t in tokens:
        ctx.decode(Batch([t], seq_ids=[[seq]]))
        out.append(ctx.get_logits(-1).clone())
    return torch.stack(out)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N_VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("name", ["toy", "mamba", "mamba2"])
@pytest.mark.parametrize("cut", [1, 7, 13])
def test_an_exact_checkpoint_continues_exactly(name, cut):
    model = models()[name]
    prompt, more = tokens(20, cut), tokens(6, 100 + cut)
    ctx = Context(model, n_seq_max=3, n_batch=64, n_ubatch=8)
    ctx.decode(Batch(prompt[:cut], seq_ids=[[0]] * cut))
    ckpt = checkpoint.take(ctx.memory, 0)
    assert ckpt is not None and ckpt.pos == cut - 1 and ckpt.codec == "exact"
    ctx.decode(Batch(prompt[cut:], seq_ids=[[0]] * (20 - cut)))  # the original moves on
    checkpoint.restore(ctx.memory, ckpt, 0)  # back into the same sequence
    checkpoint.restore(ctx.memory, ckpt, 2)  # and into another one
    assert ctx.memory.seq_pos_max(0) == ctx.memory.seq_pos_max(2) == cut - 1
    fresh = Context(model, n_seq_max=1, n_batch=64, n_ubatch=8)
    fresh.decode(Batch(prompt[:cut], seq_ids=[[0]] * cut))
    expected = feed(fresh, 0, more)
    assert torch.equal(feed(ctx, 0, more), expected)
    assert torch.equal(feed(ctx, 2, more), expected)
    ctx.memory.check_invariants()


@pytest.mark.parametrize("codec, bound", [("bf16", 0.05), ("int8", 0.05)])
def test_compressed_checkpoints_stay_close_and_are_smaller(codec, bound):
    model = models()["mamba2"]
    prompt, more = tokens(24, 5), tokens(8, 6)
    ctx = Context(model, n_seq_max=2, n_batch=64, n_ubatch=8)
    ctx.decode(Batch(prompt, seq_ids=[[0]] * len(prompt)))
    exact, lossy = checkpoint.take(ctx.memory, 0), checkpoint.take(ctx.memory, 0, codec)
    assert lossy.nbytes < exact.nbytes * (0.55 if codec == "bf16" else 0.35)
    checkpoint.restore(ctx.memory, lossy, 1)
    expected, got = feed(ctx, 0, more), feed(ctx, 1, more)
    scale = expected.abs().max()
    assert not torch.equal(expected, got)  # lossy: not bit-exact
    assert float((expected - got).abs().max() / scale) < bound


def test_an_empty_sequence_has_no_checkpoint_and_bad_codecs_are_refused():
    ctx = Context(models()["toy"], n_seq_max=2)
    assert checkpoint.take(ctx.memory, 1) is None
    with pytest.raises(ValueError, match="codec"):
        checkpoint.take(ctx.memory, 0, "fp4")


def test_restoring_over_a_shared_cell_leaves_the_sharer_intact_and_bad_shapes_change_nothing():
    model = models()["toy"]
    ctx = Context(model, n_seq_max=3, n_batch=64)
    ctx.decode(Batch.from_sequences({0: [1, 2, 3], 2: [7]}))
    ckpt = checkpoint.take(ctx.memory, 2)
    ctx.memory.seq_cp(0, 1)  # 1 shares 0's cell
    other = Context(DecayedSumModel(n_vocab=N_VOCAB, n_embd=5, n_layer=3), n_seq_max=2)
    before = snapshot(other.memory)
    with pytest.raises(ValueError, match="another shape"):
        checkpoint.restore(other.memory, ckpt, 0)
    before.assert_same(snapshot(other.memory))
    expected = feed(ctx, 0, [4, 5])  # what 0 does from its own state
    ctx.memory.seq_rm(0, -1, -1)
    ctx.decode(Batch([1, 2, 3], seq_ids=[[0]] * 3))
    checkpoint.restore(ctx.memory, ckpt, 1)  # 1 leaves the shared cell for a free one
    assert ctx.memory.seq_pos_max(1) == 0
    torch.testing.assert_close(feed(ctx, 0, [4, 5]), expected)  # 0's own state, untouched
    fresh = Context(model, n_seq_max=1)
    fresh.decode(Batch([7], seq_ids=[[0]]))
    assert torch.equal(feed(ctx, 1, [4, 5]), feed(fresh, 0, [4, 5]))
    ctx.memory.check_invariants()
