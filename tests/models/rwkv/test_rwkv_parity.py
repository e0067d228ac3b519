"""RWKV-7 and RWKV-6 against the official ``rwkv`` package (0.8.32: ``RWKV_x070`` and ``RWKV``, cpu fp32) on
random models: whole prompt, token by token, chunked prefill, several sequences in one batch, a fork,
restored states, and the state rows in llama.cpp's layout (the package's own state, value for value)."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from helpers.rwkv_reference import clone_state, random_rwkv6, random_rwkv7, reference_model
from rsmem import Batch, Context
from rsmem.loaders.rwkv.build import build_rwkv, rwkv7_from_blink
from rsmem.loaders.rwkv.rwkv6 import rwkv6_from_blink
from rsmem.loaders.tensors import ModelTensors
from rsmem.models.rwkv.rwkv6 import Rwkv6Model
from rsmem.models.rwkv.rwkv7 import Rwkv7Model

N_EMBD, N_LAYER, N_VOCAB = 128, 3, 300
PROMPT = torch.randint(0, N_VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
OTHER = torch.randint(0, N_VOCAB, (23,), generator=torch.Generator().manual_seed(2)).tolist()


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max error {err:.3g}, scale {want.abs().max().item():.3g}"


@pytest.fixture(scope="module", params=[7, 6], ids=["rwkv7", "rwkv6"])
def version(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def sd(version: int) -> dict[str, torch.Tensor]:
    return (random_rwkv7 if version == 7 else random_rwkv6)(N_EMBD, N_LAYER, N_VOCAB)


@pytest.fixture(scope="module")
def ref(sd, version, tmp_path_factory):
    return reference_model(sd, tmp_path_factory.mktemp(f"rwkv{version}"), version)


def build(sd: dict[str, torch.Tensor], **changes: int) -> Rwkv7Model | Rwkv6Model:
    v7 = "blocks.0.att.r_k" in sd
    config, tensors = (rwkv7_from_blink if v7 else rwkv6_from_blink)(sd)  # type: ignore[operator]
    arch = "rwkv7" if v7 else "rwkv6"
    return build_rwkv(ModelTensors(arch=arch, config=dataclasses.replace(config, **changes), tensors=tensors))


@pytest.fixture(scope="module")
def model(sd) -> Rwkv7Model | Rwkv6Model:
    return build(sd)


@pytest.fixture(scope="module")
def ref_prompt(ref):
    """The package's logits of every prompt token and its state after the prompt."""
    logits, state = ref.forward(PROMPT, None, full_output=True)
    return logits, clone_state(state)


def test_whole_prompt(model, ref_prompt) -> None:
    ctx = Context(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    close(ctx.logits, ref_prompt[0])


def test_token_by_token(model, ref_prompt) -> None:
    ctx = Context(model)
    for i, tok in enumerate(PROMPT[:12]):
        ctx.decode(Batch([tok]))
        close(ctx.get_logits(-1), ref_prompt[0][i])


@pytest.mark.parametrize(("n_ubatch", "chunk_size"), [(5, 64), (512, 8), (16, 3)])
def test_chunked_prefill(sd, ref_prompt, n_ubatch: int, chunk_size: int) -> None:
    ctx = Context(build(sd, chunk_size=chunk_size), n_ubatch=n_ubatch)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    close(ctx.logits, ref_prompt[0])


def test_several_sequences_in_one_batch(model, ref) -> None:
    prompts = [PROMPT, OTHER, PROMPT[5:20], OTHER[:1]]
    ctx = Context(model, n_seq_max=4)
    tokens = [t for p in prompts for t in p]
    seqs = [[s] for s, p in enumerate(prompts) for _ in p]
    ends = {sum(len(p) for p in prompts[: s + 1]) - 1 for s in range(len(prompts))}
    ctx.decode(Batch(tokens, seq_ids=seqs, logits=[i in ends for i in range(len(tokens))]))
    states = []
    for s, p in enumerate(prompts):
        want, state = ref.forward(p, None)
        close(ctx.logits[s], want)
        states.append(state)
    nxt = [7, 8, 9, 10]  # one-token decode of all four together
    ctx.decode(Batch(nxt, seq_ids=[[s] for s in range(4)], logits=[True] * 4))
    for s in range(4):
        close(ctx.logits[s], ref.forward([nxt[s]], states[s])[0])


def test_fork(model, ref, ref_prompt) -> None:
    ctx = Context(model, n_seq_max=2)
    ctx.decode(Batch(PROMPT))
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.decode(Batch([11, 12, 13, 14], seq_ids=[[0], [0], [1], [1]], logits=[False, True, False, True]))
    for s, cont in enumerate(([11, 12], [13, 14])):
        close(ctx.logits[s], ref.forward(cont, clone_state(ref_prompt[1]))[0])


def test_restored_state(model, ref, ref_prompt, tmp_path) -> None:
    ctx = Context(model, n_seq_max=2)
    ctx.decode(Batch(PROMPT))
    path = tmp_path / "seq.ggsq"
    ctx.state_seq_save_file(path, 0, PROMPT)
    blob = ctx.state_seq_get_data(0)
    fresh = Context(model, n_seq_max=2)
    assert fresh.state_seq_load_file(path, 1) == PROMPT
    fresh.state_seq_set_data(blob, 0)
    fresh.decode(Batch([5, 6, 5, 6], seq_ids=[[0], [0], [1], [1]], logits=[False, True, False, True]))
    want = ref.forward([5, 6], clone_state(ref_prompt[1]))[0]
    close(fresh.logits[0], want)
    close(fresh.logits[1], want)


def test_state_rows_are_llamacpp_layout(model, ref_prompt) -> None:
    """The sequence blob (llama.cpp's format) holds, per layer, r = [time-mix shift, channel-mix shift] and
    s = the WKV state (RWKV-7 [H, V, K], RWKV-6 [H, K, V]): the package's state[3i], [3i+2], [3i+1]."""
    ctx = Context(model)
    ctx.decode(Batch(PROMPT))
    blob = ctx.state_seq_get_data(0)
    magic, seq, n_cells = struct.unpack_from("<IiI", blob, 0)
    assert (magic, seq, n_cells) == (0xAF143CD8, 0, 1)
    pos, n_ids, s_trans, n_layer = struct.unpack_from("<iIII", blob, 12)
    assert (pos, n_ids, s_trans, n_layer) == (len(PROMPT) - 1, 0, 0, N_LAYER)
    offset = 28
    rows = []
    for _ in range(2 * N_LAYER):
        ggml_type, row_bytes = struct.unpack_from("<iQ", blob, offset)
        assert ggml_type == 0  # F32
        offset += 12
        rows.append(torch.frombuffer(bytearray(blob[offset : offset + row_bytes]), dtype=torch.float32))
        offset += row_bytes
    assert offset == len(blob)
    state = ref_prompt[1]
    for il in range(N_LAYER):
        r, s = rows[il], rows[N_LAYER + il]
        assert r.numel() == 2 * N_EMBD and s.numel() == N_EMBD * 64
        close(r[:N_EMBD], state[3 * il])
        close(r[N_EMBD:], state[3 * il + 2])
        close(s, state[3 * il + 1].flatten())
