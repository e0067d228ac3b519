"""The checkpoint file format (``rsmem.memory.checkpoint_file``): random memories, codecs and records
round-trip bit for bit, write the same bytes again, and every truncation and every byte flip is refused."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rsmem.memory import checkpoint
from rsmem.memory import checkpoint_file as cf
from rsmem.memory.checkpoint import Checkpoint, Encoded
from rsmem.memory.recurrent import RecurrentMemory, StateShape

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@st.composite
def saved(draw):
    """A memory, a sequence's tokens and (n_tokens, checkpoint) records taken from random states."""
    n_layer = draw(st.integers(1, 3))
    recurrent = draw(st.lists(st.booleans(), min_size=n_layer, max_size=n_layer).filter(any))
    shape = StateShape(n_layer, draw(st.integers(1, 70)), draw(st.integers(1, 70)))
    dtype = draw(st.sampled_from(DTYPES))
    memory = RecurrentMemory(shape, 1, dtype=dtype, layer_filter=lambda il: recurrent[il])
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
    counts = draw(st.lists(st.integers(1, len(tokens)), max_size=5, unique=True))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    records = []
    for n in counts:
        rows = [
            None if t is None else torch.randn(1, t.shape[1], generator=gen).to(dtype) for t in memory.r_l
        ]
        srows = [
            None if t is None else torch.randn(1, t.shape[1], generator=gen).to(dtype) for t in memory.s_l
        ]
        exact = Checkpoint(
            n - 1,
            "exact",
            tuple(None if r is None else Encoded(r, None, tuple(r.shape), dtype) for r in rows),
            tuple(None if r is None else Encoded(r, None, tuple(r.shape), dtype) for r in srows),
        )
        checkpoint.restore(memory, exact, 0)
        taken = checkpoint.take(memory, 0, draw(st.sampled_from(checkpoint.CODECS)))
        assert taken is not None
        records.append((n, taken))
    return memory, tokens, records


def same(a: Checkpoint, b: Checkpoint) -> bool:
    if (a.pos, a.codec) != (b.pos, b.codec):
        return False
    for x, y in zip((*a.r_rows, *a.s_rows), (*b.r_rows, *b.s_rows), strict=True):
        if (x is None) != (y is None):
            return False
        if x is not None and y is not None:
            if (x.shape, x.dtype, x.data.dtype) != (y.shape, y.dtype, y.data.dtype):
                return False
            if not torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8)):
                return False
            if (x.scales is None) != (y.scales is None):
                return False
            if x.scales is not None and y.scales is not None and not torch.equal(x.scales, y.scales):
                return False
    return True


FINGERPRINT = bytes(range(32))


@pytest.mark.fuzz
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(saved(), st.data())
def test_companions_round_trip_and_refuse_every_damage(case, data):
    memory, tokens, records = case
    layout = cf.Layout.of(memory)
    raw = cf.companion_bytes(layout, FINGERPRINT, tokens, records)

    def parse(blob: bytes, key=tokens, fp=FINGERPRINT, lay=layout):
        return cf.parse_file(blob, kind=cf.KIND_COMPANION, layout=lay, fingerprint=fp, key_tokens=key)

    back = parse(raw)
    assert [n for n, _ in back] == sorted(n for n, _ in records)
    by_n = dict(records)
    assert all(same(by_n[n], c) for n, c in back)
    ordered = sorted(records, key=lambda r: r[0])
    assert cf.companion_bytes(layout, FINGERPRINT, tokens, back) == cf.companion_bytes(
        layout, FINGERPRINT, tokens, ordered
    )
    for n, c in back:  # the decoded checkpoints restore
        checkpoint.restore(memory, c, 0)
        assert memory.seq_pos_max(0) == n - 1

    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    with pytest.raises(cf.CheckpointFileError):
        parse(raw[:cut])
    at = data.draw(st.integers(0, len(raw) - 1), label="flip at")
    bit = data.draw(st.integers(0, 7), label="bit")
    flipped = bytearray(raw)
    flipped[at] ^= 1 << bit
    with pytest.raises(cf.CheckpointFileError):
        parse(bytes(flipped))
    with pytest.raises(cf.CheckpointFileError, match="other tokens"):
        parse(raw, key=[*tokens, 1])
    with pytest.raises(cf.CheckpointFileError, match="another model"):
        parse(raw, fp=bytes(32))
    other = cf.Layout(layout.state_type, ((layout.widths[0][0] + 1, layout.widths[0][1]), *layout.widths[1:]))
    with pytest.raises(cf.CheckpointFileError, match="another shape"):
        parse(raw, lay=other)


@pytest.mark.fuzz
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(saved().filter(lambda case: bool(case[2])))
def test_entries_round_trip_and_their_header_alone_names_the_key(case):
    memory, tokens, records = case
    layout = cf.Layout.of(memory)
    n, ckpt = records[0]
    raw = cf.entry_bytes(layout, FINGERPRINT, tokens[:n], ckpt)
    assert len(raw) == cf.entry_size(layout, n, ckpt.codec)
    header = cf.read_header(io.BytesIO(raw).read)
    assert header.key_tokens == tuple(tokens[:n]) and header.kind == cf.KIND_ENTRY
    ((m, back),) = cf.parse_file(
        raw, kind=cf.KIND_ENTRY, layout=layout, fingerprint=FINGERPRINT, key_tokens=tokens[:n]
    )
    assert m == n and same(ckpt, back)
    with pytest.raises(cf.CheckpointFileError, match="kind"):
        cf.parse_file(
            raw, kind=cf.KIND_COMPANION, layout=layout, fingerprint=FINGERPRINT, key_tokens=tokens[:n]
        )


def test_non_finite_rows_are_refused():
    memory = RecurrentMemory(StateShape(1, 4, 4), 1)
    layout = cf.Layout.of(memory)
    bad = torch.tensor([[0.0, float("nan"), 1.0, 2.0]])
    ckpt = Checkpoint(
        0, "exact", (Encoded(bad, None, (1, 4), torch.float32),), (Encoded(bad, None, (1, 4), torch.float32),)
    )
    raw = cf.companion_bytes(layout, FINGERPRINT, [7], [(1, ckpt)])
    with pytest.raises(cf.CheckpointFileError, match="NaN"):
        cf.parse_file(raw, kind=cf.KIND_COMPANION, layout=layout, fingerprint=FINGERPRINT, key_tokens=[7])


def test_the_fingerprint_samples_large_embeddings_and_tells_models_apart():
    from types import SimpleNamespace

    layout = cf.Layout.of(RecurrentMemory(StateShape(1, 4, 4), 1))
    n = 50280 * 768  # a 130M Mamba's embedding: a float32 linspace over it rounded past its end
    big = SimpleNamespace(arch="mamba", n_vocab=50280, embedding=torch.zeros(1).expand(n))
    other = SimpleNamespace(arch="mamba", n_vocab=50280, embedding=torch.ones(1).expand(n))
    assert cf.model_fingerprint(big, layout) != cf.model_fingerprint(other, layout)
    assert cf.model_fingerprint(SimpleNamespace(inner=big), layout) == cf.model_fingerprint(big, layout)


def test_the_fingerprint_sees_a_change_in_one_layer_matrix():
    from rsmem.models import Mamba2Config
    from rsmem.models.mamba.random_init import random_mamba2

    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=64, d_state=8, n_head=4, n_group=2, chunk_size=4)
    model = random_mamba2(cfg, seed=3)
    layout = cf.Layout.of(RecurrentMemory(StateShape(2, model.n_embd_r, model.n_embd_s), 1))
    before = cf.model_fingerprint(model, layout)
    assert cf.model_fingerprint(random_mamba2(cfg, seed=3), layout) == before
    with torch.no_grad():
        model.layers[1].out_proj.add_(1.0)
    assert cf.model_fingerprint(model, layout) != before
