"""State bytes: llama.cpp byte compatibility, round trips, and rejection of bad bytes with nothing lost."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch

from helpers.memory import decode_seq, snapshot, toy_context
from rsmem import Context, StateFormatError
from rsmem.memory import state_io
from rsmem.memory.recurrent import RecurrentMemory, StateShape
from rsmem.models import DecayedSumModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"  # see its README.md
# (n_embd_r, n_embd_s) of the fixture models, from SPEC section 3
FIXTURE_SHAPES = {"mamba": (3 * 128, 16 * 128), "mamba2": (3 * (128 + 2 * 2 * 16), 16 * 128)}


def fixture_memory(arch: str, n_seq_max: int = 4) -> RecurrentMemory:
    return RecurrentMemory(StateShape(2, *FIXTURE_SHAPES[arch]), n_seq_max)


def llamacpp_blob(arch: str, wtype: str) -> bytes:
    """``llama_state_seq_get_data`` of sequence 0 as llama.cpp wrote it. Only the f32 blob is kept in the
    repository: a blob is its 8-byte header (magic, seq id 0) and then the bytes of the sequence file
    after its tokens, which the f32 pair shows (test below), so the others are built from their ``.ggsq``."""
    if wtype == "f32":
        return (FIXTURES / arch / "state-seq0-f32.bin").read_bytes()
    data = (FIXTURES / arch / f"state-seq0-{wtype}.ggsq").read_bytes()
    n_tokens = struct.unpack_from("<I", data, 8)[0]
    return struct.pack("<Ii", state_io.SEQ_BLOB_MAGIC, 0) + data[12 + 4 * n_tokens :]


# ------------------------------------------------------- llama.cpp's bytes


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
@pytest.mark.parametrize("wtype", ["f32", "bf16", "q8_0"])
def test_llamacpp_sequence_blob_parses_and_is_rewritten_byte_for_byte(arch, wtype):
    data = llamacpp_blob(arch, wtype)
    mem = fixture_memory(arch)
    assert state_io.load_seq_blob(mem, data, 0) == len(data)
    assert mem.seq_pos_max(0) == 11  # the 12-token prompt
    assert state_io.seq_blob(mem, 0) == data
    # into another sequence: the payload is the same, only the source id in the header differs
    state_io.load_seq_blob(mem, data, 3)
    assert state_io.seq_blob(mem, 3) == data[:4] + struct.pack("<i", 3) + data[8:]
    mem.check_invariants()


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
@pytest.mark.parametrize("wtype", ["f32", "bf16", "q8_0"])
def test_llamacpp_sequence_file_parses_and_is_rewritten_byte_for_byte(arch, wtype):
    data = (FIXTURES / arch / f"state-seq0-{wtype}.ggsq").read_bytes()
    mem = fixture_memory(arch)
    tokens = state_io.load_seq_file_bytes(mem, data, 1)
    assert tokens == [5, 17, 42, 99, 3, 250, 7, 77, 123, 64, 31, 200]
    assert state_io.seq_file_bytes(mem, 1, tokens) == data
    if wtype == "f32":  # the file's payload is the blob's payload (what llamacpp_blob relies on)
        blob = (FIXTURES / arch / "state-seq0-f32.bin").read_bytes()
        assert data[12 + 4 * len(tokens) :] == blob[8:]


def test_llamacpp_state_loads_into_bf16_memory():
    data = (FIXTURES / "mamba" / "state-seq0-f32.bin").read_bytes()
    f32 = fixture_memory("mamba")
    bf16 = RecurrentMemory(StateShape(2, *FIXTURE_SHAPES["mamba"]), 2, dtype=torch.bfloat16)
    state_io.load_seq_blob(f32, data, 0)
    state_io.load_seq_blob(bf16, data, 0)
    c32, c16 = f32.cells.tail[0], bf16.cells.tail[0]
    torch.testing.assert_close(bf16.s_l[1][c16].float(), f32.s_l[1][c32], rtol=1e-2, atol=1e-2)
    # and writes BF16 rows (ggml type 30) back
    assert struct.unpack_from("<i", state_io.seq_blob(bf16, 0), 8 + 4 + 8 + 8)[0] == 30


# ------------------------------------------------------------- round trips


def test_restore_into_another_sequence_continues_identically():
    model, ctx = toy_context(n_seq_max=3)
    decode_seq(ctx, 0, [1, 2, 3, 4])
    blob = ctx.state_seq_get_data(0)
    ctx.state_seq_set_data(blob, 2)
    assert ctx.memory.seq_pos_max(2) == 3
    ctx.memory.check_invariants()
    decode_seq(ctx, 2, [5])
    got = ctx.get_logits(-1).clone()
    decode_seq(ctx, 0, [5])
    assert torch.equal(got, ctx.get_logits(-1))
    torch.testing.assert_close(got, model.reference_logits([1, 2, 3, 4, 5])[-1], atol=1e-5, rtol=0)


def test_restore_into_a_fresh_context_via_file(tmp_path):
    model, ctx = toy_context(n_seq_max=2)
    decode_seq(ctx, 1, [7, 8, 9])
    path = tmp_path / "seq.ggsq"
    written = ctx.state_seq_save_file(path, 1, [7, 8, 9])
    assert written == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["seq.ggsq"]  # no temporary file left behind

    fresh = Context(model, n_seq_max=4)
    assert fresh.state_seq_load_file(path, 3) == [7, 8, 9]
    decode_seq(fresh, 3, [10])
    torch.testing.assert_close(
        fresh.get_logits(-1), model.reference_logits([7, 8, 9, 10])[-1], atol=1e-5, rtol=0
    )


def test_restore_of_empty_sequence_empties_destination():
    model, ctx = toy_context(n_seq_max=2)
    decode_seq(ctx, 0, [1, 2])
    empty = ctx.state_seq_get_data(1)
    ctx.state_seq_set_data(empty, 0)
    assert ctx.memory.seq_pos_max(0) == -1
    assert ctx.memory.used == 0


def test_restore_over_a_shared_cell_leaves_the_other_sequence_intact():
    model, ctx = toy_context(n_seq_max=3)
    decode_seq(ctx, 0, [1, 2])
    ctx.memory.seq_cp(0, 1)
    decode_seq(ctx, 2, [5, 6, 7])
    ctx.state_seq_set_data(ctx.state_seq_get_data(2), 0)
    decode_seq(ctx, 1, [3])
    torch.testing.assert_close(ctx.get_logits(-1), model.reference_logits([1, 2, 3])[-1], atol=1e-5, rtol=0)
    decode_seq(ctx, 0, [8])
    torch.testing.assert_close(
        ctx.get_logits(-1), model.reference_logits([5, 6, 7, 8])[-1], atol=1e-5, rtol=0
    )


def test_session_file_round_trip(tmp_path):
    model, ctx = toy_context(n_seq_max=3)
    decode_seq(ctx, 0, [1, 2])
    decode_seq(ctx, 2, [3, 4, 5])
    ctx.memory.seq_cp(2, 1)
    path = tmp_path / "session.ggsn"
    ctx.state_save_file(path, [1, 2])
    fresh = Context(model, n_seq_max=3)
    assert fresh.state_load_file(path) == [1, 2]
    assert [fresh.memory.seq_pos_max(s) for s in range(3)] == [1, 2, 2]
    assert fresh.memory.used == 2
    fresh.memory.check_invariants()
    decode_seq(fresh, 1, [6])
    torch.testing.assert_close(
        fresh.get_logits(-1), model.reference_logits([3, 4, 5, 6])[-1], atol=1e-5, rtol=0
    )


def test_whole_context_data_round_trip_is_exact():
    model, ctx = toy_context(n_seq_max=3)
    decode_seq(ctx, 0, [1, 2])
    decode_seq(ctx, 2, [3])
    data = ctx.state_get_data()
    fresh = Context(model, n_seq_max=3)
    assert fresh.state_set_data(data) == len(data)
    assert fresh.state_get_data() == data


# ------------------------------------------------------- rejected bytes


def _ctx_with_two_sequences():
    model, ctx = toy_context(n_seq_max=3)
    decode_seq(ctx, 0, [1, 2, 3])
    decode_seq(ctx, 1, [4, 5])
    return ctx


def test_every_truncation_is_rejected_with_memory_unchanged():
    ctx = _ctx_with_two_sequences()
    blob = ctx.state_seq_get_data(0)
    before = snapshot(ctx.memory)
    for n in range(len(blob)):
        with pytest.raises(StateFormatError):
            ctx.state_seq_set_data(blob[:n], 1)
        before.assert_same(snapshot(ctx.memory))
    with pytest.raises(StateFormatError, match="unexpected bytes"):
        ctx.state_seq_set_data(blob + b"\0", 1)
    before.assert_same(snapshot(ctx.memory))


def _flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_bit_flip_sweep_of_a_blob():
    """Every flipped bit is either rejected (memory unchanged) or is a value the format allows.

    The header and metadata are swept bit by bit. Flips that stay valid are the low 31 bits of the
    cell position and of the source seq id (the format carries no checksum: any non-negative value is
    legal there); for those the load must succeed and carry the flipped value. The row data is plain
    floats: a flip there loads and round-trips exactly, unless it made the value NaN or inf, which is
    refused with the memory unchanged.
    """
    ctx = _ctx_with_two_sequences()
    blob = ctx.state_seq_get_data(0)
    n_meta = 8 + 4 + 8 + 8  # blob header, cell count, one cell header, s_trans + n_layer
    row_bytes = 4 * 4  # one cell of 4 floats per layer and kind
    layer_headers = [n_meta + k * (12 + row_bytes) for k in range(4)]  # r0, r1, s0, s1
    header_bytes = set(range(n_meta)) | {h + k for h in layer_headers for k in range(12)}
    valid = {4 * 8 + b for b in range(31)} | {12 * 8 + b for b in range(31)}  # source id, pos
    before = snapshot(ctx.memory)
    for bit in sorted(8 * byte + b for byte in header_bytes for b in range(8)):
        bad = _flip(blob, bit)
        if bit in valid:
            ctx.state_seq_set_data(bad, 2)
            assert ctx.state_seq_get_data(2)[8:] == bad[8:]
            ctx.memory.seq_rm(2, -1, -1)
            before = snapshot(ctx.memory)
            continue
        with pytest.raises(StateFormatError):
            ctx.state_seq_set_data(bad, 1)
        before.assert_same(snapshot(ctx.memory))
    data_bits = [8 * byte + b for byte in range(len(blob)) if byte not in header_bytes for b in range(8)]
    assert len(data_bits) == 4 * row_bytes * 8
    refused = 0
    for bit in data_bits:
        bad = _flip(blob, bit)
        value_at = (bit // 8) // 4 * 4
        if math.isfinite(struct.unpack_from("<f", bad, value_at)[0]):
            ctx.state_seq_set_data(bad, 2)
            assert ctx.state_seq_get_data(2)[8:] == bad[8:]
            continue
        before = snapshot(ctx.memory)  # an exponent flip that made the value NaN or inf
        with pytest.raises(StateFormatError, match="non-finite"):
            ctx.state_seq_set_data(bad, 2)
        before.assert_same(snapshot(ctx.memory))
        refused += 1
    assert refused > 0  # exponent flips of values in [1, 2) make an inf or a NaN


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (DecayedSumModel(n_vocab=32, n_embd=4, n_layer=3), "3 layers, the model 2"),
        (DecayedSumModel(n_vocab=32, n_embd=5, n_layer=2), "row size is 20 bytes, this model needs 16"),
    ],
)
def test_state_of_another_model_is_rejected(other, message):
    model, ctx = toy_context(n_seq_max=2)
    src = Context(other, n_seq_max=1)
    decode_seq(src, 0, [1, 2])
    decode_seq(ctx, 0, [3])
    before = snapshot(ctx.memory)
    with pytest.raises(StateFormatError, match=message):
        ctx.state_seq_set_data(src.state_seq_get_data(0), 0)
    before.assert_same(snapshot(ctx.memory))


def test_whole_state_with_too_many_cells_or_duplicate_tails_is_rejected():
    model, big = toy_context(n_seq_max=4)
    for s in range(4):
        decode_seq(big, s, [s + 1])
    small = Context(model, n_seq_max=2)
    with pytest.raises(StateFormatError, match="4 cells, the memory only 2"):
        small.state_set_data(big.state_get_data())

    model, ctx = toy_context(n_seq_max=2)
    decode_seq(ctx, 0, [1])
    decode_seq(ctx, 1, [2])
    data = bytearray(ctx.state_get_data())
    arch_len = struct.unpack_from("<I", data)[0]
    cells_at = 4 + arch_len + 4
    # cell 1's seq id (after pos, n_seq_id) is set to 0, which cell 0 already holds
    struct.pack_into("<i", data, cells_at + 12 + 8, 0)
    before = snapshot(ctx.memory)
    with pytest.raises(StateFormatError, match="seq id 0 already has a tail"):
        ctx.state_set_data(bytes(data))
    before.assert_same(snapshot(ctx.memory))


def test_session_file_of_another_arch_or_magic_is_rejected(tmp_path):
    model, ctx = toy_context()
    decode_seq(ctx, 0, [1])
    path = tmp_path / "s.ggsn"
    ctx.state_save_file(path, [1])
    data = path.read_bytes()
    with pytest.raises(StateFormatError, match="not a session file"):
        state_io.load_session_file_bytes(ctx.memory, b"xxxx" + data[4:], model.arch)
    with pytest.raises(StateFormatError, match="saved by a 'rsmem-toy' model"):
        state_io.load_session_file_bytes(ctx.memory, data, "mamba")
    with pytest.raises(StateFormatError, match="version 8 is not supported"):
        state_io.load_session_file_bytes(ctx.memory, data[:4] + struct.pack("<I", 8) + data[8:], model.arch)


def test_sequence_file_with_bad_token_count_is_rejected(tmp_path):
    model, ctx = toy_context()
    decode_seq(ctx, 0, [1])
    path = tmp_path / "s.ggsq"
    ctx.state_seq_save_file(path, 0, [1])
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, 10**6)
    path.write_bytes(bytes(data))
    with pytest.raises(StateFormatError, match="tokens do not fit"):
        ctx.state_seq_load_file(path, 0)


@pytest.mark.parametrize("token", [-1, 10**9])
def test_files_with_tokens_outside_the_vocabulary_are_refused_with_memory_unchanged(tmp_path, token):
    model, ctx = toy_context(n_seq_max=2)
    decode_seq(ctx, 0, [1, 2])
    decode_seq(ctx, 1, [3])
    seq_path, session_path = tmp_path / "s.ggsq", tmp_path / "s.ggsn"
    ctx.state_seq_save_file(seq_path, 0, [1, token])
    ctx.state_save_file(session_path, [token])
    before = snapshot(ctx.memory)
    with pytest.raises(StateFormatError, match=r"token 1: id .* outside the vocabulary"):
        ctx.state_seq_load_file(seq_path, 1)
    with pytest.raises(StateFormatError, match=r"token 0: id .* outside the vocabulary"):
        ctx.state_load_file(session_path)
    before.assert_same(snapshot(ctx.memory))


# ------------------------------------------------------- non-finite states


def _poisoned_source(kind: str, il: int, value: float) -> Context:
    """Sequences 0 and 1 decoded; one value of sequence 1's layer ``il`` ``kind`` row set to ``value``."""
    model, src = toy_context(n_seq_max=3)
    decode_seq(src, 0, [1, 2, 3])
    decode_seq(src, 1, [4, 5])
    rows = (src.memory.r_l if kind == "r" else src.memory.s_l)[il]
    assert rows is not None
    rows[src.memory.cells.tail[1], 2] = value
    return src


NON_FINITE = [("NaN", math.nan), ("inf", math.inf), ("inf", -math.inf)]


@pytest.mark.parametrize(("name", "value"), NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("il", [0, 1])
@pytest.mark.parametrize("kind", ["r", "s"])
def test_non_finite_sequence_state_is_refused_with_memory_unchanged(tmp_path, kind, il, name, value):
    src = _poisoned_source(kind, il, value)
    blob = src.state_seq_get_data(1)
    src.state_seq_save_file(tmp_path / "s.ggsq", 1, [4, 5])
    ctx = _ctx_with_two_sequences()
    before = snapshot(ctx.memory)
    message = rf"layer {il}: the {kind} state for sequence {{}} holds 1 non-finite values: {name}$"
    for dest in (0, 2):  # over a sequence that holds a state, and into an empty one
        with pytest.raises(StateFormatError, match=message.format(dest)):
            ctx.state_seq_set_data(blob, dest)
        before.assert_same(snapshot(ctx.memory))
        with pytest.raises(StateFormatError, match=message.format(dest)):
            ctx.state_seq_load_file(tmp_path / "s.ggsq", dest)
        before.assert_same(snapshot(ctx.memory))


@pytest.mark.parametrize(("name", "value"), NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["r", "s"])
def test_non_finite_session_state_is_refused_with_memory_unchanged(tmp_path, kind, name, value):
    src = _poisoned_source(kind, 1, value)
    src.memory.seq_cp(1, 2)  # the poisoned cell is shared: the message lists both sequences
    src.state_save_file(tmp_path / "all.ggsn", [4, 5])
    data = src.state_get_data()
    ctx = _ctx_with_two_sequences()
    before = snapshot(ctx.memory)
    message = rf"layer 1: the {kind} state of cell \d+ \(sequences 1, 2\) holds 1 non-finite values: {name}$"
    with pytest.raises(StateFormatError, match=message):
        ctx.state_load_file(tmp_path / "all.ggsn")
    before.assert_same(snapshot(ctx.memory))
    with pytest.raises(StateFormatError, match=message):
        ctx.state_set_data(data)
    before.assert_same(snapshot(ctx.memory))


def test_finite_values_that_overflow_a_float16_memory_are_refused():
    model, src = toy_context(n_seq_max=2)
    decode_seq(src, 0, [1, 2])
    s0 = src.memory.s_l[0]
    assert s0 is not None
    s0[src.memory.cells.tail[0], 1] = 1e6  # finite in float32, above float16's 65504
    ctx = Context(model, n_seq_max=2, state_dtype=torch.float16)
    decode_seq(ctx, 1, [3])
    before = snapshot(ctx.memory)
    with pytest.raises(StateFormatError, match=r"layer 0: the s state for sequence 0 .* out of range"):
        ctx.state_seq_set_data(src.state_seq_get_data(0), 0)
    before.assert_same(snapshot(ctx.memory))
    s0[src.memory.cells.tail[0], 1] = 6e4  # in range: loads
    ctx.state_seq_set_data(src.state_seq_get_data(0), 0)
    assert ctx.memory.seq_pos_max(0) == 1
