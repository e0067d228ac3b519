"""State files of hybrid models through the Context (llama.cpp's hybrid layout: the KV part, then the
recurrent payload) and the command line: blobs, .ggsq sequence files and .ggsn session files round-trip
and continue exactly; llama.cpp's own state loads through ``Context``; 0-value recurrent rows (LFM2 keeps
no SSM state) parse in ``state_io``; ``rsmem generate --save-state/--load-state`` and ``rsmem info``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.cli import main
from rsmem.errors import StateFormatError
from rsmem.memory import state_io
from rsmem.memory.recurrent import RecurrentMemory, StateShape

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
NAMES = ["lfm2", "nemotron_h"]


@pytest.fixture(scope="module", params=NAMES)
def named(request):
    return request.param, rsmem.load_model(FIXTURES / request.param / "model-f32.gguf")


def _ctx(model, n_seq_max: int = 2) -> Context:
    return Context(model, n_seq_max=n_seq_max, n_ctx=512, n_ubatch=16)


def _next_logits(ctx: Context, seq: int, tokens: list[int]) -> torch.Tensor:
    ctx.decode(Batch(tokens, seq_ids=[[seq]] * len(tokens)))
    return ctx.get_logits(-1).clone()


PROMPT = [5, 17, 42, 99, 3, 250, 7, 77, 123, 64, 31, 200]
MORE = [11, 12, 13]


def test_sequence_blob_and_file_round_trip_and_continue(named, tmp_path):
    _, model = named
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    blob = ctx.state_seq_get_data(0)
    assert ctx.state_seq_get_size(0) == len(blob)
    ctx.state_seq_save_file(tmp_path / "s.ggsq", 0, PROMPT)
    want = _next_logits(ctx, 0, MORE)

    other = _ctx(model)
    assert other.state_seq_set_data(blob, 0) == len(blob)
    assert other.state_seq_get_data(0) == blob  # the same bytes read back
    assert torch.equal(_next_logits(other, 0, MORE), want)
    assert other.state_seq_load_file(tmp_path / "s.ggsq", 1) == PROMPT  # into the other KV stream
    assert torch.equal(_next_logits(other, 1, MORE), want)


def test_session_files_and_context_state_hold_every_sequence(named, tmp_path):
    name, model = named
    ctx = _ctx(model)
    ctx.decode(Batch.from_sequences({0: PROMPT, 1: PROMPT[:5]}))
    ctx.state_save_file(tmp_path / "all.ggsn", PROMPT)
    data = ctx.state_get_data()
    want = [_next_logits(ctx, s, MORE) for s in (0, 1)]

    for load in ("file", "data"):
        other = _ctx(model)
        if load == "file":
            assert other.state_load_file(tmp_path / "all.ggsn") == PROMPT
        else:
            assert other.state_set_data(data) == len(data)
        assert [other.memory.seq_pos_max(s) for s in (0, 1)] == [11, 4]
        for s in (0, 1):
            assert torch.equal(_next_logits(other, s, MORE), want[s])
    stranger = _ctx(
        rsmem.load_model(FIXTURES / ("lfm2" if name != "lfm2" else "nemotron_h") / "model-f32.gguf")
    )
    with pytest.raises(StateFormatError):
        stranger.state_set_data(data)


def test_llama_cpp_state_loads_through_the_context(named, tmp_path):
    name, model = named
    blob = (FIXTURES / name / "state-seq0-f32.bin").read_bytes()
    prompt = json.loads((FIXTURES / name / "fixture.json").read_text())["prompt"]
    ctx = _ctx(model)
    ctx.state_seq_set_data(blob, 0)
    assert ctx.state_seq_get_data(0) == blob  # byte-identical to what llama.cpp wrote
    ggsq = struct.pack(f"<III{len(prompt)}i", 0x67677371, 3, len(prompt), *prompt) + blob[8:]
    (tmp_path / "l.ggsq").write_bytes(ggsq)
    assert ctx.state_seq_load_file(tmp_path / "l.ggsq", 1) == prompt
    fresh = _ctx(model)
    fresh.decode(Batch(prompt))
    assert torch.allclose(_next_logits(ctx, 1, MORE), _next_logits(fresh, 0, MORE), atol=1e-5, rtol=0)


def test_zero_value_rows_parse_in_state_io():
    """A memory whose s rows are 0 values wide (LFM2's): torch.frombuffer refused the empty rows."""
    memory = RecurrentMemory(StateShape(2, 4, 0), 2)
    memory.find_slot(memory_ubatch())
    memory.r_l[0][memory.cells.tail[0]] = torch.arange(4.0)  # type: ignore[index]
    data = state_io.write_payload(memory, 0)
    payload = state_io.parse_payload(state_io.Reader(data), memory, 1)
    assert [tuple(t.shape) for t in payload.s_rows if t is not None] == [(1, 0), (1, 0)]
    assert torch.equal(payload.r_rows[0], torch.arange(4.0).view(1, 4))
    state_io.restore_payload(memory, payload, 1)
    assert memory.seq_pos_max(1) == 0


def memory_ubatch():
    from rsmem.batch.allocator import BatchAllocator

    return BatchAllocator.ubatch_reserve(1, 1, seq_id=0, pos=[0])


# ------------------------------------------------------------ command line


def test_generate_saves_and_continues_a_hybrid_state(tmp_path, capsys):
    path = str(FIXTURES / "lfm2" / "model-f32.gguf")
    state = str(tmp_path / "h.ggsq")
    common = ["-m", path, "-n", "4", "--temp", "0", "--ignore-eos"]
    assert main(["generate", "hello", *common, "--save-state", state]) == 0  # AttributeError before
    first = capsys.readouterr()
    assert "saved 9 tokens" in first.err
    assert main(["generate", " more", *common, "--load-state", state]) == 0
    assert "restored 9 tokens" in capsys.readouterr().err
    assert main(["generate", "hello more", *common, "-c", "256", "-np", "1"]) == 0


def test_generate_refuses_a_prompt_over_the_ctx_size(tmp_path, capsys):
    path = str(FIXTURES / "lfm2" / "model-f32.gguf")
    assert main(["generate", "ab" * 200, "-m", path, "-c", "256", "-n", "2"]) == 1
    assert "max context of 256" in capsys.readouterr().err
    assert main(["generate", "ab", "-m", path, "-c", "0", "-n", "2"]) == 1
    assert "--ctx-size 0" in capsys.readouterr().err


def test_info_shows_kv_bytes_per_token_and_state_per_sequence(capsys):
    assert main(["info", str(FIXTURES / "nemotron_h" / "model-f32.gguf")]) == 0  # refused before
    out = capsys.readouterr().out
    model = rsmem.load_model(FIXTURES / "nemotron_h" / "model-f32.gguf")
    memory = Context(model, n_ctx=256).memory
    assert f"state per seq:   {memory.state_bytes_per_seq()} bytes" in out
    assert "attention:       1 layer (1)" in out
    assert f"KV per token:    {memory.kv_bytes_per_token()} bytes" in out  # type: ignore[attr-defined]
