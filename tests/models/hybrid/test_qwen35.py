"""Qwen3.5 (``qwen35``) against llama.cpp's own outputs (tests/fixtures/llamacpp/qwen35, see its README):
logits of the prompt and the continuation (whole, token by token, in chunks, four sequences in one batch, a
fork), the sequence state llama.cpp wrote (the same bytes, floats up to rounding; its .ggsq restores and
continues), the n_rs_seq rollback case, the engine on it, and the delta rule's chunked form against its
token-by-token twin.

Measured: prompt logits 1.5e-5 from llama.cpp's (2.0e-5 from transformers'), continuation 9.0e-6 (1.1e-5);
llama.cpp and transformers differ by 2.9e-5 here, transformers in fp32 and fp64 by 4.6e-5."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.engine import Engine, SamplingParams
from rsmem.errors import StateFormatError
from rsmem.loaders import read_tensors
from rsmem.loaders.hybrid.build import build_hybrid
from rsmem.loaders.hybrid.qwen35 import qwen35_config_from_gguf
from rsmem.memory import checkpoint, state_io
from rsmem.memory.hybrid import HybridMemory
from rsmem.models.hybrid.qwen35 import Qwen35Model
from rsmem.models.ops.delta_net import delta_rule_chunked, delta_rule_ref, l2_norm, unit_lower_inverse

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "qwen35"
FX = json.loads((FIXTURES / "fixture.json").read_text())
PROMPT, CONT = FX["prompt"], FX["continuation"]
ATOL = 4e-5  # llama.cpp f32 vs rsmem: this model's float32 rounding is large (README) and moves with threads
REF_ATOL = 3e-5  # transformers f32 vs rsmem (measured 2.0e-5)


def _npy(name: str) -> torch.Tensor:
    return torch.from_numpy(np.load(FIXTURES / name))


@pytest.fixture(scope="module")
def model() -> Qwen35Model:
    m = rsmem.load_model(FIXTURES / "model-f32.gguf")
    assert isinstance(m, Qwen35Model)
    return m


def _ctx(model, **kw) -> Context:
    kw.setdefault("n_seq_max", 2)
    kw.setdefault("n_ctx", 512)
    return Context(model, **kw)


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    err = (got - want).abs().max().item()
    assert err < atol, err


def test_loads_as_a_hybrid(model) -> None:
    assert model.arch == "qwen35"
    assert dict(model.kv_layers) == {3: (32, 32)}
    assert [model.is_recurrent_layer(il) for il in range(4)] == [True, True, True, False]
    assert model.n_embd_r == 3 * 128 and model.n_embd_s == 4 * 16 * 16
    cfg = model.config
    assert (cfg.n_rot, cfg.rope_sections, cfg.n_k_heads, cfg.n_v_heads) == (4, (1, 1, 0, 0), 2, 4)
    memory = _ctx(model).memory
    assert isinstance(memory, HybridMemory) and memory.kv.cell_ext


def test_prompt_and_continuation_match_llamacpp_and_transformers(model) -> None:
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    _close(ctx.logits, _npy("logits-prompt-f32.npy"))
    _close(ctx.logits, _npy("ref-logits-prompt.npy"), REF_ATOL)
    ctx.decode(Batch(CONT, logits=[True] * len(CONT)))
    _close(ctx.logits, _npy("logits-continuation-f32.npy"))
    _close(ctx.logits, _npy("ref-logits-continuation.npy"), REF_ATOL)


def test_token_by_token_and_in_chunks(model) -> None:
    want = torch.cat([_npy("logits-prompt-f32.npy"), _npy("logits-continuation-f32.npy")])
    ctx = _ctx(model)
    rows = []
    for t in PROMPT + CONT:
        ctx.decode(Batch([t]))
        rows.append(ctx.logits[0].clone())
    _close(torch.stack(rows), want)
    ctx = _ctx(model)
    tokens, rows, start = PROMPT + CONT, [], 0
    for n in (5, 1, 4, 5):
        part = tokens[start : start + n]
        ctx.decode(Batch(part, pos=list(range(start, start + n)), logits=[True] * n))
        rows.append(ctx.logits.clone())
        start += n
    _close(torch.cat(rows), want)


@pytest.mark.parametrize("unified", [False, True])
def test_four_sequences_in_one_batch_then_decoded_together(model, unified: bool) -> None:
    ctx = _ctx(model, n_seq_max=4, n_ctx=4 * 256, kv_unified=unified)
    ctx.decode(Batch.from_sequences({s: PROMPT for s in range(4)}, all_logits=True))
    want = _npy("logits-prompt-f32.npy")
    for s in range(4):
        _close(ctx.logits[s * len(PROMPT) : (s + 1) * len(PROMPT)], want)
    cont = _npy("logits-continuation-f32.npy")
    for i, t in enumerate(CONT):  # one token of each of the 4 sequences per step
        ctx.decode(Batch.from_sequences({s: [t] for s in range(4)}))
        for s in range(4):
            _close(ctx.get_logits(s), cont[i])


def test_a_fork_continues_the_prompt(model) -> None:
    ctx = _ctx(model, n_seq_max=3, n_ctx=768)
    ctx.decode(Batch(PROMPT))
    ctx.memory.seq_cp(0, 2)
    ctx.decode(Batch(CONT, seq_ids=[[2]] * len(CONT), logits=[True] * len(CONT)))
    _close(ctx.logits, _npy("logits-continuation-f32.npy"))
    ctx.decode(Batch(CONT[:1], seq_ids=[[0]]))  # the source is untouched by the fork's tokens
    _close(ctx.logits, _npy("logits-continuation-f32.npy")[:1])


def _float_regions(layout: dict) -> list[tuple[int, int]]:
    stream = layout["attention"]["streams"][0]
    entries = stream["k"] + stream["v"] + layout["recurrent"]["r"] + layout["recurrent"]["s"]
    return [(e["offset"], e["bytes"]) for e in entries]


def _assert_like_llamacpp(got: bytes, want: bytes) -> None:
    """Every byte outside the float rows equal (cell metadata with llama.cpp's ext, layer headers); the
    float rows within ATOL (K after RoPE, V, conv windows, delta-net states)."""
    assert len(got) == len(want) == FX["state_blob"]["layout"]["total_bytes"]
    mask = np.ones(len(want), dtype=bool)
    for off, size in _float_regions(FX["state_blob"]["layout"]):
        mask[off : off + size] = False
        a = np.frombuffer(got[off : off + size], dtype=np.float32)
        b = np.frombuffer(want[off : off + size], dtype=np.float32)
        assert np.abs(a - b).max() < ATOL, off
    assert (np.frombuffer(got, np.uint8)[mask] == np.frombuffer(want, np.uint8)[mask]).all()


def test_state_blob_is_llamacpps(model) -> None:
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    blob = state_io.seq_blob(ctx.memory, 0)
    _assert_like_llamacpp(blob, (FIXTURES / "state-seq0-f32.bin").read_bytes())
    cell_1 = struct.unpack_from("<iIiiii", blob, 40)  # pos, n_seq_id, ext x, y, tok, seq id
    assert cell_1 == (1, 1, 1, 1, PROMPT[1], 0)


@pytest.mark.parametrize("dest", [0, 1])
def test_llamacpp_ggsq_restores_and_continues(model, dest: int, tmp_path: Path) -> None:
    ctx = _ctx(model)
    assert ctx.state_seq_load_file(FIXTURES / "state-seq0-f32.ggsq", dest) == PROMPT
    ctx.memory.check_invariants()
    assert ctx.memory.seq_pos_max(dest) == len(PROMPT) - 1
    blob = (FIXTURES / "state-seq0-f32.bin").read_bytes()
    again = _ctx(model)  # written back and read again as sequence 0: bit for bit llama.cpp's blob
    state_io.load_seq_blob(again.memory, state_io.seq_blob(ctx.memory, dest), 0)
    assert state_io.seq_blob(again.memory, 0) == blob
    ctx.decode(Batch(CONT, seq_ids=[[dest]] * len(CONT), logits=[True] * len(CONT)))
    _close(ctx.logits, _npy("logits-continuation-f32.npy"))
    saved = tmp_path / "again.ggsq"
    other = _ctx(model)  # loaded into sequence 0 and saved: llama.cpp's file again
    other.state_seq_load_file(FIXTURES / "state-seq0-f32.ggsq", 0)
    other.state_seq_save_file(saved, 0, PROMPT)
    assert saved.read_bytes() == (FIXTURES / "state-seq0-f32.ggsq").read_bytes()


def test_rollback_matches_llamacpp(model) -> None:
    """The fixture's n_rs_seq case: prompt as one batch, cut its last 2 positions, decode 2 other tokens."""
    ctx = _ctx(model, n_rs_seq=3)
    ctx.decode(Batch(PROMPT))
    assert ctx.memory.seq_rm(0, 10, -1) is True
    assert ctx.memory.seq_pos_max(0) == 9
    ctx.decode(Batch([21, 22], logits=[True, True]))
    _close(ctx.logits, _npy("rollback-logits.npy"))
    _assert_like_llamacpp(
        state_io.seq_blob(ctx.memory, 0), (FIXTURES / "rollback-state-seq0.bin").read_bytes()
    )
    assert ctx.memory.seq_rm(0, 5, -1) is False  # deeper than the window: refused


def test_engine_batches_and_forks_as_alone(model) -> None:
    """The engine (continuous batching, an n=2 fork) on Qwen3.5 generates what one request alone does."""

    def engine(n: int) -> Engine:
        return Engine(Context(model, n_seq_max=n, n_ctx=512 * n, n_batch=64, n_ubatch=16))

    greedy = SamplingParams.greedy(max_tokens=5)
    prompts = [PROMPT, [(3 + 7 * k) % 300 for k in range(70)], PROMPT[:4]]
    alone = []
    for p in prompts:
        e = engine(1)
        e.add_request(p, greedy)
        alone.append(next(o for o in e.run_until_done() if o.finished).outputs[0].token_ids)
    e = engine(4)
    ids = e.add_requests(prompts, greedy)
    done = {o.request_id: o for o in e.run_until_done() if o.finished}
    assert [done[i].outputs[0].token_ids for i in ids] == alone
    e = engine(3)
    rid = e.add_request(PROMPT, SamplingParams.greedy(max_tokens=5, n=2))
    out = next(o for o in e.run_until_done() if o.finished and o.request_id == rid)
    assert [c.token_ids for c in out.outputs] == [alone[0], alone[0]]


@pytest.mark.parametrize(("n_tokens", "chunk"), [(1, 64), (12, 64), (70, 64), (130, 16), (9, 4)])
def test_chunked_delta_rule_equals_token_by_token(n_tokens: int, chunk: int) -> None:
    torch.manual_seed(n_tokens)
    f64 = torch.float64
    bs, h, dk, dv = 2, 3, 8, 6
    q = l2_norm(torch.randn(bs, n_tokens, h, dk, dtype=f64), 1e-6) / dk**0.5
    k = l2_norm(torch.randn(bs, n_tokens, h, dk, dtype=f64), 1e-6)
    v = torch.randn(bs, n_tokens, h, dv, dtype=f64)
    g = -torch.rand(bs, n_tokens, h, dtype=f64) * 4
    beta = torch.rand(bs, n_tokens, h, dtype=f64)
    state = torch.randn(bs, h, dv, dk, dtype=f64)
    want_o, want_s = delta_rule_ref(q, k, v, g, beta, state)
    got_s = state.clone()
    got_o = delta_rule_chunked(q, k, v, g, beta, got_s, chunk)
    assert (got_o - want_o).abs().max().item() < 1e-12
    assert (got_s - want_s).abs().max().item() < 1e-12


def test_chunked_delta_rule_in_float32_keeps_strong_decays_exact() -> None:
    """Decays summed in float32 (c_i - c_j of large sums) put the outputs 1.1e-6 from float64's here; the
    decays in float64 keep float32's own rounding (6e-8, token by token 4e-8)."""
    torch.manual_seed(1)
    f64 = torch.float64
    q = l2_norm(torch.randn(1, 64, 4, 16, dtype=f64), 1e-6) / 4.0
    k = l2_norm(torch.randn(1, 64, 4, 16, dtype=f64), 1e-6)
    v = torch.randn(1, 64, 4, 16, dtype=f64)
    g = -torch.rand(1, 64, 4, dtype=f64) * 8
    beta = torch.rand(1, 64, 4, dtype=f64)
    want_o, want_s = delta_rule_ref(q, k, v, g, beta, torch.zeros(1, 4, 16, 16, dtype=f64))
    state = torch.zeros(1, 4, 16, 16)
    got_o = delta_rule_chunked(q.float(), k.float(), v.float(), g.float(), beta.float(), state)
    assert (got_o.double() - want_o).abs().max().item() < 3e-7
    assert (state.double() - want_s).abs().max().item() < 3e-7


@pytest.mark.parametrize("size", [64, 40, 5])
def test_unit_lower_inverse(size: int) -> None:
    torch.manual_seed(size)
    a = torch.randn(3, 2, size, size, dtype=torch.float64).tril(-1) * 0.3
    eye = torch.eye(size, dtype=torch.float64)
    assert (unit_lower_inverse(a) - torch.linalg.inv(eye + a)).abs().max().item() < 1e-9


def test_seq_add_rotates_the_stored_keys(model) -> None:
    """Positions moved by seq_add (llama.cpp asserts on it for M-RoPE; rsmem re-rotates the keys with NeoX
    RoPE over n_rot, llama.cpp's K-shift for these models): the continuation equals a fresh sequence that
    saw the prompt at the moved positions."""
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    ctx.memory.seq_add(0, 0, -1, 5)
    ctx.decode(Batch(CONT, pos=[17, 18, 19], logits=[True] * 3))
    fresh = _ctx(model)
    fresh.decode(Batch(PROMPT, pos=list(range(5, 17))))
    fresh.decode(Batch(CONT, pos=[17, 18, 19], logits=[True] * 3))
    _close(ctx.logits, fresh.logits, 1e-5)
    blob = state_io.seq_blob(ctx.memory, 0)
    assert struct.unpack_from("<iIiii", blob, 16) == (5, 1, 5, 5, PROMPT[0])  # ext x, y follow the position


def test_corrupt_states_are_refused_with_the_memory_untouched(model) -> None:
    blob = bytearray((FIXTURES / "state-seq0-f32.bin").read_bytes())
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT[:4], seq_ids=[[1]] * 4))
    before = ctx.memory.state_write(-1)
    bad = (
        [blob[:n] for n in (4, 12, 30, 300, 320, 2000, 3420, 8000, len(blob) - 1)]
        + [
            blob + b"\0",
            blob[:20] + struct.pack("<I", 2) + blob[24:],  # a cell listing two seq ids
            blob[:3428] + struct.pack("<I", 5) + blob[3432:],  # five model layers
        ]
    )
    for data in bad:
        with pytest.raises(StateFormatError):
            state_io.load_seq_blob(ctx.memory, bytes(data), 0)
        assert ctx.memory.state_write(-1) == before
        ctx.memory.check_invariants()


def test_rollback_after_one_token_decodes_is_exact(model) -> None:
    """Cuts llama.cpp b11312 gets wrong (one-token decodes after the batch, the whole last batches cut)
    equal a fresh sequence fed the kept tokens: the replay runs the delta nets and reads the KV cache."""
    ctx = _ctx(model, n_rs_seq=3)
    ctx.decode(Batch(PROMPT))
    ctx.decode(Batch([30]))
    ctx.decode(Batch([31]))
    assert ctx.memory.seq_rm(0, 12, -1) is True
    ctx.decode(Batch([21], logits=[True]))
    fresh = _ctx(model)
    fresh.decode(Batch([*PROMPT, 21]))
    _close(ctx.logits, fresh.logits, 1e-5)
    ctx.memory.check_invariants()


@pytest.mark.parametrize("unified", [False, True])
def test_a_restored_checkpoint_continues_as_a_fresh_sequence(model, unified: bool) -> None:
    """A prefix-cache checkpoint (delta-net rows plus the KV prefix) restored into its own sequence after it
    moved on and into another one continues as a fresh sequence fed the same tokens."""
    prompt = [(1 + 7 * k) % 300 for k in range(70)]
    ctx = Context(model, n_seq_max=3, n_ctx=768, kv_unified=unified, n_ubatch=32)
    ctx.decode(Batch(prompt))
    ckpt = checkpoint.take(ctx.memory, 0)
    assert ckpt is not None and ckpt.kv is not None
    ctx.decode(Batch([50, 51, 52], seq_ids=[[0]] * 3))  # sequence 0 moves on
    fresh = _ctx(model, n_ubatch=32)  # the same chunks: this model's rounding shows another chunking's
    fresh.decode(Batch(prompt))
    for dest in (0, 2):
        checkpoint.restore(ctx.memory, ckpt, dest)
    ctx.memory.check_invariants()
    for tok in CONT:  # one sequence a step, as the fresh one: several rows take other products, whose
        fresh.decode(Batch([tok]))  # rounding this model amplifies to a few 1e-5
        for dest in (0, 2):
            ctx.decode(Batch([tok], seq_ids=[[dest]]))
            # one KV stream: attention also masks the other sequences' cells, so its sums round
            # differently (0.5-1.4e-6 seen, with or without the C++ prompt convolution)
            _close(ctx.get_logits(-1), fresh.get_logits(-1), 3e-6 if unified else 1e-6)


def test_gguf_metadata_with_mtp_layers_and_without_layer_flags() -> None:
    """An MTP block (nextn_predict_layers) is left out of the trunk; without attention.recurrent_layers
    every full_attention_interval-th layer is attention (llama.cpp's rule)."""
    meta = {
        "block_count": 5,
        "nextn_predict_layers": 1,
        "attention.recurrent_layers": [True, True, True, False, False],
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
        "ssm.conv_kernel": 4,
        "ssm.state_size": 16,
        "ssm.group_count": 2,
        "ssm.time_step_rank": 4,
        "ssm.inner_size": 64,
        "rope.dimension_count": 4,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    cfg = qwen35_config_from_gguf(meta.__getitem__, 300, meta.get)
    assert cfg.n_layer == 4 and cfg.recurrent == (True, True, True, False)
    del meta["attention.recurrent_layers"], meta["nextn_predict_layers"]
    meta["block_count"] = 8
    cfg = qwen35_config_from_gguf(meta.__getitem__, 300, meta.get)
    assert cfg.recurrent == (True, True, True, False) * 2


def test_a_tied_head_shares_the_embedding() -> None:
    """Without output.weight the head is the embedding: one held copy (Qwen3.5's small models tie them),
    the same logits as a file with the embedding written twice."""
    ckpt = read_tensors(FIXTURES / "model-f32.gguf")
    ckpt.tensors["output.weight"] = ckpt.tensors["token_embd.weight"].clone()
    untied = build_hybrid(ckpt)
    del ckpt.tensors["output.weight"]
    tied = build_hybrid(ckpt)
    assert isinstance(tied, Qwen35Model) and tied.embedding.data_ptr() == tied.lm_head.data_ptr()
    logits = []
    for m in (tied, untied):
        ctx = _ctx(m)
        ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
        logits.append(ctx.logits)
    assert torch.equal(logits[0], logits[1])
