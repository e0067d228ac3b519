"""RWKV-7's and RWKV-6's one-token decode steps in C++ (kernels/csrc/rwkv7_step.cpp, rwkv6_step.cpp through
models/step/native.py): the model's decode of one and several sequences through the op against the
eager model (logits and state rows), RWKV-6 with its residual halved every layer; the op against the
compiled step's function row by row, the matrices as the few-row kernel's rows, oneDNN's packed twins or
their row slices; bad operands rejected before any state is written; the first call's check and its
fallbacks."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from test_rwkv_gguf import rwkv6_gguf

import rsmem
from rsmem import Batch, Context
from rsmem.kernels.build import native_ops
from rsmem.models.step import native as native_step
from rsmem.models.step.compiled import has_cxx_compiler
from rsmem.models.step.native import (
    PACKED_FROM_ROWS,
    PACKED_HEAD_FROM_ROWS,
    SLICED_F32,
    SLICED_FROM_ROWS,
    NativeStep,
)

pytestmark = pytest.mark.compiled

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "rwkv"
needs_cxx = pytest.mark.skipif(not has_cxx_compiler(), reason="the kernels need a C++ compiler")


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    original = NativeStep.run

    def counted(self, x, *args):  # type: ignore[no-untyped-def]
        calls.append((self.op, x.shape[0]))
        return original(self, x, *args)

    monkeypatch.setattr(NativeStep, "run", counted)
    return calls


def _decode(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three prompts of different lengths, one sequence alone, then three and two together (some rows
    without logits); each step's logits and every sequence's state rows after."""
    ctx = Context(model, n_seq_max=3)
    prompts = [[(7 * i + s) % 290 + 1 for i in range(5 + 4 * s)] for s in range(3)]
    ctx.decode(
        Batch([t for p in prompts for t in p], seq_ids=[[s] for s, p in enumerate(prompts) for _ in p])
    )
    out = []
    for k in range(3):
        ctx.decode(Batch([11 + k], seq_ids=[[1]]))
        out.append(ctx.logits.clone())
    for k, width in enumerate((3, 2, 3)):
        toks = [(13 * s + 5 * k) % 290 + 1 for s in range(width)]
        ctx.decode(Batch(toks, seq_ids=[[s] for s in range(width)], logits=[s != 1 for s in range(width)]))
        out.append(ctx.logits.clone())
    rows = [torch.frombuffer(bytearray(ctx.state_seq_get_data(s)), dtype=torch.uint8) for s in range(3)]
    return out, rows


def _state_floats(blob: torch.Tensor, n_layer: int, n_embd: int, head_size: int) -> list[torch.Tensor]:
    """The float32 rows of a one-sequence state blob (r rows of every layer, then s rows)."""
    rows, offset = [], 28
    data = bytes(blob.tolist())
    for row_bytes in [2 * n_embd * 4] * n_layer + [n_embd * head_size * 4] * n_layer:
        rows.append(
            torch.frombuffer(bytearray(data[offset + 12 : offset + 12 + row_bytes]), dtype=torch.float32)
        )
        offset += 12 + row_bytes
    assert offset == len(data)
    return rows


def _paths(tmp_path: Path) -> dict[str, Path]:
    return {
        "rwkv7": FIXTURES / "rwkv7" / "model-f32.gguf",
        "rwkv6": FIXTURES / "rwkv6" / "model-f32.gguf",
        "rwkv6-rescaled": rwkv6_gguf(tmp_path, 1),
    }


@needs_cxx
@pytest.mark.parametrize("which", ["rwkv7", "rwkv6", "rwkv6-rescaled"])
def test_native_decode_matches_eager(which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _paths(tmp_path)[which]
    eager = rsmem.load_model(path, compile=False)
    want, want_states = _decode(eager)
    native_ops()
    model = rsmem.load_model(path, compile=True)
    calls = _counting(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed check would fall back silently
        got, got_states = _decode(model)
    op = f"{model.arch}_step"
    assert model._native is not None and model._native.failed is None
    assert calls == [(op, w) for w in (1, 1, 1, 3, 2, 3)]
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    cfg = model.config
    for a, b in zip(got_states, want_states, strict=True):
        for ra, rb in zip(
            _state_floats(a, cfg.n_layer, cfg.d_model, cfg.head_size),
            _state_floats(b, cfg.n_layer, cfg.d_model, cfg.head_size),
            strict=True,
        ):
            assert rb.abs().max() > 0
            torch.testing.assert_close(ra, rb, rtol=0, atol=1e-5 * float(rb.abs().max()))


@needs_cxx
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_contexts_taking_turns_on_one_model_match_models_of_their_own(arch: str) -> None:
    """Two contexts decode by turns on one model, whose step keeps what it built from the last step's state
    rows: each context's logits and states are those of a model that serves it alone (a step that reused
    the other context's rows would read and write them)."""
    native_ops()
    path = FIXTURES / arch / "model-f32.gguf"
    shared = rsmem.load_model(path, compile=True)
    turns = [Context(shared, n_seq_max=2) for _ in range(2)]
    alone = [Context(rsmem.load_model(path, compile=True), n_seq_max=2) for _ in range(2)]
    for c in range(2):
        prompt = Batch([3 + c, 9, 27 + c], seq_ids=[[0]] * 3)
        turns[c].decode(prompt)
        alone[c].decode(prompt)
    for k in range(3):
        for c in range(2):
            for ctx in (turns[c], alone[c]):
                ctx.decode(Batch([5 + 7 * k + c], seq_ids=[[0]]))
            assert torch.equal(turns[c].logits, alone[c].logits)
    assert shared._native is not None and shared._native.failed is None
    for c in range(2):
        assert turns[c].state_seq_get_data(0) == alone[c].state_seq_get_data(0)
    assert turns[0].state_seq_get_data(0) != turns[1].state_seq_get_data(0)


def _step_operands(arch: str, n: int = 3):
    """The model, and the op's arguments for one token of each of ``n`` sequences (copies of states)."""
    native_ops()
    model = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=True)
    native = model._native
    assert native is not None
    cfg = model.config
    gen = torch.Generator().manual_seed(3)
    flat = []
    for fields in model._fields_one:
        shift = torch.randn(n, 2, cfg.d_model, generator=gen)
        wkv = torch.randn(n, cfg.n_head, cfg.head_size, cfg.head_size, generator=gen) * 0.3
        flat += [*fields, shift, wkv]
    x = model.embedding[(torch.arange(n) * 47 + 3) % model.embedding.shape[0]]
    return model, native, x, flat


@needs_cxx
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
@pytest.mark.parametrize(
    ("n", "sliced"),
    [
        (3, True),
        (SLICED_FROM_ROWS, True),
        (PACKED_FROM_ROWS + 3, True),
        (PACKED_HEAD_FROM_ROWS, False),
        (PACKED_FROM_ROWS + 3, False),
    ],
)
def test_op_rows_match_the_twin(arch: str, n: int, sliced: bool) -> None:
    """``n`` rows through the op at once against the compiled step's function, one row at a time: from
    SLICED_FROM_ROWS rows the op takes every float32 matrix as oneDNN packed slices of its rows (three
    here); without them, from PACKED_HEAD_FROM_ROWS the head as its packed twin, from PACKED_FROM_ROWS every
    float32 matrix."""
    model, native, x, flat = _step_operands(arch, n)
    native.sliced, native.n_slices = sliced, 3
    n_fields = native.n_fields
    mine = [t.clone() if i % n_fields >= n_fields - 2 else t for i, t in enumerate(flat)]
    got = native(x, model.norm_f, model._head_one, model.config.eps, *mine)
    for row in range(n):
        theirs = [t[row : row + 1].clone() if i % n_fields >= n_fields - 2 else t for i, t in enumerate(flat)]
        want = native.twin(x[row : row + 1], model.norm_f, model._head_one, model.config.eps, *theirs)
        torch.testing.assert_close(got[row : row + 1], want, rtol=1e-5, atol=1e-5)
        for i in range(0, len(flat), n_fields):
            for k in (n_fields - 2, n_fields - 1):
                torch.testing.assert_close(mine[i + k][row : row + 1], theirs[i + k], rtol=1e-5, atol=1e-5)
    took_slices = (False, False, True) in native._cache
    assert took_slices == (sliced and n >= SLICED_FROM_ROWS)
    if took_slices:
        _, _, qtypes, _, head_q, slices = native._cache[False, False, True]
        assert set(qtypes) == {SLICED_F32} and head_q == SLICED_F32 and len(slices) == 3 * (len(qtypes) + 1)


def _decode_many(model, n: int) -> list[torch.Tensor]:
    """Short prompts of ``n`` sequences, then two steps of all of them together: those steps' logits."""
    ctx = Context(model, n_seq_max=n)
    ctx.decode(Batch([(5 * s) % 290 + 1 for s in range(n)], seq_ids=[[s] for s in range(n)]))
    out = []
    for k in range(2):
        ctx.decode(Batch([(7 * s + k) % 290 + 1 for s in range(n)], seq_ids=[[s] for s in range(n)]))
        out.append(ctx.logits.clone())
    return out


@needs_cxx
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_many_sequences_through_the_slices_match_eager(arch: str) -> None:
    path = FIXTURES / arch / "model-f32.gguf"
    want = _decode_many(rsmem.load_model(path, compile=False), SLICED_FROM_ROWS)
    native_ops()
    model = rsmem.load_model(path, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = _decode_many(model, SLICED_FROM_ROWS)
    assert model._native is not None and model._native.sliced and (False, False, True) in model._native._cache
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@needs_cxx
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_check_catches_slices_out_of_order(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each matrix's two row slices swapped (the products' halves in each other's place): the first call of
    SLICED_FROM_ROWS rows warns and the op keeps its other forms, its logits right."""
    path = FIXTURES / arch / "model-f32.gguf"
    want = _decode_many(rsmem.load_model(path, compile=False), SLICED_FROM_ROWS)
    original = native_step.row_slices
    monkeypatch.setattr(native_step, "row_slices", lambda plain, n: original(plain, n)[::-1])
    native_ops()
    model = rsmem.load_model(path, compile=True)
    assert model._native is not None
    model._native.n_slices = 2
    with pytest.warns(
        RuntimeWarning, match=f"{arch}_step keeps its products off sliced matrices: its .* differ"
    ):
        got = _decode_many(model, SLICED_FROM_ROWS)
    assert not model._native.sliced and model._native.failed is None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@needs_cxx
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_bad_operands_are_errors_before_any_write(arch: str) -> None:
    model, native, x, flat = _step_operands(arch)
    n = native.n_fields
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in flat]
    short_shift = list(flat)
    short_shift[-n - 2] = flat[-n - 2][:, :1]  # the last but one layer's shift rows cut
    short_state = list(flat)
    short_state[-1] = flat[-1][:2]  # the last layer's WKV state for two rows of three
    for bad, what in ((short_shift, "shift"), (short_state, "wkv")):
        with pytest.raises(ValueError, match=what):
            native(x, model.norm_f, model._head_one, model.config.eps, *bad)
    with pytest.raises(ValueError, match="x must be"):
        native(x.double(), model.norm_f, model._head_one, model.config.eps, *flat)
    # the sliced form: a matrix's slices one row short, a slice count that does not divide the list
    native.n_slices = 2
    layers, qtypes, head_w, head_q, slices = native._build_sliced(model._head_one, flat)
    op = getattr(native_ops(), native.op)
    short = [*slices[:2], torch.ops.mkldnn._reorder_linear_weight(head_w[:5].contiguous(), 8), *slices[3:]]
    with pytest.raises(ValueError, match="slices hold"):
        op(x, layers, qtypes, model.norm_f, head_w, head_q, *native.consts, short, 2)
    with pytest.raises(ValueError, match="2 slices for each"):
        op(x, layers, qtypes, model.norm_f, head_w, head_q, *native.consts, slices[:-1], 2)
    for a, b in zip(flat, before, strict=True):
        assert a is b or torch.equal(a, b)


@needs_cxx
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_check_catches_a_differing_op(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An op given a wrong constant (the layer norms' eps) passes its own checks but not the comparison: a
    warning, and the compiled step from then on, its logits right."""
    path = FIXTURES / arch / "model-f32.gguf"
    want, _ = _decode(rsmem.load_model(path, compile=False))
    native_ops()
    model = rsmem.load_model(path, compile=True)
    assert model._native is not None
    model._native.consts = (0.5, *model._native.consts[1:])
    calls = _counting(monkeypatch)
    with pytest.warns(RuntimeWarning, match=f"{arch}_step is not used: its .* differ"):
        got, _ = _decode(model)
    assert calls == [] and model._native.failed is not None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
