"""One sequence's hybrid state moves between contexts of any stream count (issue 37, item 6).

A KV cache has one stream per sequence, or one in all with ``kv_unified``, and a sequence's state bytes
list every stream of the cache they came from (llama.cpp's layout, the others empty). Such a state loads
into a context of any ``n_seq_max`` and ``kv_unified`` and continues exactly; a whole context's state
still needs as many streams, and the refusal names the settings that load it. The command line's own
files move between ``generate`` (4 sequences by default) and ``generate -np 1``.
"""

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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
PROMPT = [5, 17, 42, 99, 3, 250, 7, 77, 123, 64, 31, 200]
MORE = [11, 12, 13]
# (n_seq_max, kv_unified): the KV streams are n_seq_max, or 1 when unified
SHAPES = [(1, False), (2, False), (4, False), (3, True)]


@pytest.fixture(scope="module", params=["lfm2", "qwen35"])
def model(request):
    return rsmem.load_model(FIXTURES / request.param / "model-f32.gguf")


def _ctx(model, shape: tuple[int, bool]) -> Context:
    n_seq_max, unified = shape
    return Context(model, n_seq_max=n_seq_max, n_ctx=256 * n_seq_max, kv_unified=unified)


def _next_logits(ctx: Context, seq: int, tokens: list[int]) -> torch.Tensor:
    ctx.decode(Batch(tokens, seq_ids=[[seq]] * len(tokens)))
    return ctx.get_logits(-1).clone()


@pytest.mark.parametrize("src", SHAPES, ids=lambda s: f"from{s[0]}{'u' if s[1] else ''}")
def test_a_sequence_file_loads_into_any_stream_count(model, src, tmp_path):
    ctx = _ctx(model, src)
    seq = src[0] - 1  # the last sequence: its own stream, not stream 0, when not unified
    ctx.decode(Batch(PROMPT, seq_ids=[[seq]] * len(PROMPT)))
    path = tmp_path / "s.ggsq"
    ctx.state_seq_save_file(path, seq, PROMPT)
    blob = ctx.state_seq_get_data(seq)
    want = _next_logits(ctx, seq, MORE)
    for dst in SHAPES:
        other = _ctx(model, dst)
        dest = dst[0] - 1
        assert other.state_seq_load_file(path, dest) == PROMPT  # StateFormatError before: n_stream
        assert torch.equal(_next_logits(other, dest, MORE), want), dst
        again = _ctx(model, dst)
        assert again.state_seq_set_data(blob, 0) == len(blob)
        assert torch.allclose(_next_logits(again, 0, MORE), want, atol=1e-5, rtol=0), dst


def test_llama_cpp_two_stream_state_loads_with_any_stream_count():
    """llama.cpp's Qwen3.5 state was written with n_seq_max 2 (two streams, the second empty)."""
    model = rsmem.load_model(FIXTURES / "qwen35" / "model-f32.gguf")
    blob = (FIXTURES / "qwen35" / "state-seq0-f32.bin").read_bytes()
    assert struct.unpack_from("<I", blob, 8)[0] == 2
    prompt = json.loads((FIXTURES / "qwen35" / "fixture.json").read_text())["prompt"]
    fresh = _ctx(model, (1, False))
    fresh.decode(Batch(prompt))
    want = _next_logits(fresh, 0, MORE)
    for shape in SHAPES:
        ctx = _ctx(model, shape)
        ctx.state_seq_set_data(blob, 0)
        assert torch.allclose(_next_logits(ctx, 0, MORE), want, atol=1e-5, rtol=0), shape
        if shape == (2, False):
            ctx = _ctx(model, shape)
            ctx.state_seq_set_data(blob, 0)
            assert ctx.state_seq_get_data(0) == blob  # still byte-identical where the streams agree


def test_a_whole_context_state_names_the_settings_it_needs(model):
    ctx = _ctx(model, (4, False))
    ctx.decode(Batch(PROMPT))
    data = ctx.state_get_data()
    for shape in ((1, False), (2, True)):
        other = _ctx(model, shape)
        before = other.state_get_data()
        with pytest.raises(StateFormatError, match=r"4 streams .*-np 4, without kv_unified / --kv-unified"):
            other.state_set_data(data)
        assert other.state_get_data() == before
    unified = _ctx(model, (2, True))
    unified.decode(Batch(PROMPT))
    with pytest.raises(StateFormatError, match=r"1 stream .*--kv-unified, or n_seq_max / -np 1"):
        _ctx(model, (4, False)).state_set_data(unified.state_get_data())


def test_a_sequence_state_larger_than_a_stream_says_so(model):
    """A unified cache's sequence may hold more cells than another context's stream has."""
    ctx = _ctx(model, (2, True))  # 512 cells, shared
    tokens = [t % 200 + 1 for t in range(300)]
    ctx.decode(Batch(tokens))
    blob = ctx.state_seq_get_data(0)
    small = _ctx(model, (1, False))  # 256 cells
    with pytest.raises(StateFormatError, match=r"300 KV cells .* a sequence here has 256 .*n_ctx / -c"):
        small.state_seq_set_data(blob, 0)
    assert small.memory.seq_pos_max(0) == -1


def test_the_command_line_moves_a_state_between_sequence_counts(tmp_path, capsys):
    path = str(FIXTURES / "lfm2" / "model-f32.gguf")
    common = ["-m", path, "-n", "4", "--temp", "0", "--ignore-eos", "-c", "1024"]
    four, one = str(tmp_path / "four.ggsq"), str(tmp_path / "one.ggsq")
    assert main(["generate", "hello", *common, "--save-state", four]) == 0  # -np 4 by default
    capsys.readouterr()
    assert main(["generate", " more", *common, "-np", "1", "--load-state", four, "--save-state", one]) == 0
    assert "restored 9 tokens" in capsys.readouterr().err  # 'KV state has 4 streams' before
    assert main(["generate", " again", *common, "--load-state", one]) == 0
    assert "restored 18 tokens" in capsys.readouterr().err
