"""``SequenceMemory``, the protocol the Context uses, carries what it needs of a memory: both memories
offer every member with a compatible signature, and a state written and read through the protocol
(``state_write`` / ``state_read``, framed by ``state_io``) is byte for byte the direct path's, for a
recurrent memory (llama.cpp's Mamba blob) and a hybrid one (llama.cpp's LFM2 blob)."""

from __future__ import annotations

import inspect
import struct
from pathlib import Path

import pytest

import rsmem
from rsmem import Batch, Context
from rsmem.errors import StateFormatError
from rsmem.memory import state_io
from rsmem.memory.hybrid import HybridMemory
from rsmem.memory.kv_state import write_kv
from rsmem.memory.protocol import SequenceMemory
from rsmem.memory.recurrent import RecurrentMemory, StateShape
from rsmem.memory.state_io import Reader

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
MAMBA_SHAPE = StateShape(2, 3 * 128, 16 * 128)  # the Mamba fixture (SPEC section 3)
HEADER = 8  # a blob's magic and source seq id, before the memory's state bytes


def _members() -> list[str]:
    return sorted(n for n in vars(SequenceMemory) if not n.startswith("_"))


def _params(fn: object) -> list[tuple[str, object, object]]:
    """``fn``'s parameters after the first (``self``, or a delegate's memory): name, kind, default."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params]


def test_the_protocol_names_what_the_context_asks_of_a_memory():
    assert {"state_write", "state_read", "kv_cells_per_seq", "capture_memory"} <= set(_members())


@pytest.mark.parametrize("cls", [RecurrentMemory, HybridMemory])
def test_every_member_exists_with_the_protocols_signature(cls):
    memory: SequenceMemory = (
        RecurrentMemory(StateShape(2, 3, 5), 2) if cls is RecurrentMemory else _lfm2_context().memory
    )
    assert type(memory) is cls
    for name in _members():
        spec = vars(SequenceMemory)[name]
        assert hasattr(memory, name), f"{cls.__name__} lacks {name}"
        if isinstance(spec, property):
            own = inspect.getattr_static(memory, name)
            assert not callable(own) or isinstance(own, property), f"{cls.__name__}.{name} is a method"
            continue
        impl = getattr(cls, name)
        assert callable(impl), f"{cls.__name__}.{name} is not a method"
        assert _params(impl) == _params(spec), f"{cls.__name__}.{name}{inspect.signature(impl)}"


# ---------------------------------------------------------------- recurrent


def test_recurrent_state_through_the_protocol_is_the_direct_payload():
    blob = (FIXTURES / "mamba" / "state-seq0-f32.bin").read_bytes()
    direct = RecurrentMemory(MAMBA_SHAPE, 4)
    state_io.load_seq_blob(direct, blob, 0)
    assert state_io.write_payload(direct, 0) == blob[HEADER:]

    memory: SequenceMemory = RecurrentMemory(MAMBA_SHAPE, 4)
    memory.state_read(Reader(blob[HEADER:]), 2)
    assert memory.state_write(2) == blob[HEADER:] == state_io.write_payload(direct, 0)
    assert memory.seq_pos_max(2) == direct.seq_pos_max(0) == 11
    whole = memory.state_write(-1)
    assert whole == state_io.write_payload(memory, -1)
    again: SequenceMemory = RecurrentMemory(MAMBA_SHAPE, 4)
    again.state_read(Reader(whole))
    assert again.state_write(-1) == whole
    assert state_io.seq_blob(again, 2) == blob[:4] + struct.pack("<i", 2) + blob[HEADER:]


def test_recurrent_state_read_needs_the_state_to_end_the_data():
    blob = (FIXTURES / "mamba" / "state-seq0-f32.bin").read_bytes()
    memory = RecurrentMemory(MAMBA_SHAPE, 2)
    with pytest.raises(StateFormatError):
        memory.state_read(Reader(blob[HEADER:] + b"\0"), 0)
    assert memory.seq_ids() == []


# ---------------------------------------------------------------- hybrid

_LFM2: list[object] = []


def _lfm2_context() -> Context:
    if not _LFM2:
        _LFM2.append(rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf"))
    return Context(_LFM2[0], n_seq_max=2, n_ctx=512)


def test_hybrid_state_through_the_protocol_is_the_kv_part_then_the_payload():
    blob = (FIXTURES / "lfm2" / "state-seq0-f32.bin").read_bytes()
    ctx = _lfm2_context()
    assert ctx.state_seq_set_data(blob, 0) == len(blob)
    memory = ctx.memory
    assert isinstance(memory, HybridMemory)
    direct = write_kv(memory.kv, 0) + state_io.write_payload(memory.recurrent, 0)
    assert memory.state_write(0) == direct == blob[HEADER:]
    assert ctx.state_seq_get_data(0) == blob

    other = _lfm2_context()
    other.memory.state_read(Reader(direct), 1)  # into the other KV stream
    moved = other.memory.state_write(1)
    assert isinstance(other.memory, HybridMemory)
    assert moved == write_kv(other.memory.kv, 1) + state_io.write_payload(other.memory.recurrent, 1)
    assert moved != direct  # the KV part names the stream its cells are in
    ctx.decode(Batch([5, 17, 42], seq_ids=[[1]] * 3))  # a second sequence in the whole-memory state
    whole = memory.state_write(-1)
    assert whole == write_kv(memory.kv, -1) + state_io.write_payload(memory.recurrent, -1)
    other.memory.state_read(Reader(whole))
    assert other.memory.state_write(-1) == whole
    assert other.state_get_data() == ctx.state_get_data()


def test_hybrid_state_read_needs_the_state_to_end_the_data():
    blob = (FIXTURES / "lfm2" / "state-seq0-f32.bin").read_bytes()
    ctx = _lfm2_context()
    before = ctx.memory.state_write(-1)
    with pytest.raises(StateFormatError):
        ctx.memory.state_read(Reader(blob[HEADER:] + b"\0"), 0)
    assert ctx.memory.state_write(-1) == before


def test_only_a_recurrent_memory_offers_captures_and_only_a_hybrid_bounds_a_sequence():
    recurrent = RecurrentMemory(StateShape(2, 3, 5), 2)
    assert recurrent.capture_memory() is recurrent and recurrent.kv_cells_per_seq is None
    ctx = _lfm2_context()
    assert ctx.memory.capture_memory() is None
    assert ctx.memory.kv_cells_per_seq == ctx.max_seq_tokens == 256
    with pytest.raises(ValueError, match="captures need a recurrent memory"):
        ctx.decode(Batch([5, 17]), capture={0: [1]})
