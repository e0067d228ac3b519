"""rsmem against transformers' MambaForCausalLM / Mamba2ForCausalLM full forwards, on tiny random models
loaded from the saved HF folder and from the GGUF rsmem converts it to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.loaders import convert_hf_to_gguf

pytest.importorskip("transformers")
from helpers.tiny_hf import N_VOCAB, reference_logits, save_hf_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=["mamba", "mamba2"])
def hf_model(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, folder)
    return request.param, model, folder


@pytest.fixture(scope="module", params=["hf", "gguf", "compiled"])
def loaded(request, hf_model, tmp_path_factory):
    """(reference model, rsmem model) with rsmem loading the folder or the converted GGUF; "compiled" loads
    the folder with one-token steps through torch.compile (models.compiled), as large models run."""
    arch, ref, folder = hf_model
    if request.param == "hf":
        return ref, rsmem.load_model(folder)
    if request.param == "compiled":
        model = rsmem.load_model(folder, compile=True)
        assert model.compile_decode
        return ref, model
    path = tmp_path_factory.mktemp("gguf") / f"{arch}.gguf"
    convert_hf_to_gguf(folder, path, outtype="f32")
    return ref, rsmem.load_model(path)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N_VOCAB, (n,), generator=g).tolist()


def _decode(ctx: rsmem.Context, seqs: dict[int, list[int]], all_logits: bool = True) -> None:
    tokens, seq_ids, logits = [], [], []
    for s, toks in seqs.items():
        tokens += toks
        seq_ids += [[s]] * len(toks)
        logits += [all_logits] * (len(toks) - 1) + [True]
    ctx.decode(rsmem.Batch(tokens, seq_ids=seq_ids, logits=logits))


def test_whole_prompt(loaded) -> None:
    ref, model = loaded
    toks = _prompt(40, 1)
    ctx = rsmem.Context(model, n_seq_max=1)
    _decode(ctx, {0: toks})
    torch.testing.assert_close(ctx.logits, reference_logits(ref, toks), rtol=0, atol=ATOL)


def test_token_by_token(loaded) -> None:
    ref, model = loaded
    toks = _prompt(12, 2)
    ctx = rsmem.Context(model, n_seq_max=1)
    got = []
    for t in toks:
        _decode(ctx, {0: [t]})
        got.append(ctx.get_logits(0))
    torch.testing.assert_close(torch.stack(got), reference_logits(ref, toks), rtol=0, atol=ATOL)


def test_chunked_prefill(loaded) -> None:
    ref, model = loaded
    toks = _prompt(30, 3)
    ctx = rsmem.Context(model, n_seq_max=1, n_batch=64, n_ubatch=7)  # ubatches split inside calls too
    got = []
    for i, j in [(0, 11), (11, 12), (12, 30)]:
        _decode(ctx, {0: toks[i:j]})
        got.append(ctx.logits)
    torch.testing.assert_close(torch.cat(got), reference_logits(ref, toks), rtol=0, atol=ATOL)


def test_four_sequences_of_different_lengths(loaded) -> None:
    ref, model = loaded
    seqs = {s: _prompt(n, 10 + s) for s, n in enumerate([5, 13, 1, 8])}
    ctx = rsmem.Context(model, n_seq_max=4)
    _decode(ctx, seqs)
    start = 0
    for toks in seqs.values():
        got = ctx.logits[start : start + len(toks)]
        torch.testing.assert_close(got, reference_logits(ref, toks), rtol=0, atol=ATOL)
        start += len(toks)
    # then one batched decode step for all four
    nxt = {s: [(7 * s + 3) % N_VOCAB] for s in seqs}
    _decode(ctx, nxt)
    for k, s in enumerate(seqs):
        want = reference_logits(ref, seqs[s] + nxt[s])[-1]
        torch.testing.assert_close(ctx.logits[k], want, rtol=0, atol=ATOL)


def test_fork_with_seq_cp(loaded) -> None:
    ref, model = loaded
    prompt, a, b = _prompt(9, 4), _prompt(4, 5), _prompt(6, 6)
    ctx = rsmem.Context(model, n_seq_max=2)
    _decode(ctx, {0: prompt})
    ctx.memory.seq_cp(0, 1)
    _decode(ctx, {0: a[:2], 1: b[:2]})
    _decode(ctx, {0: a[2:]})
    _decode(ctx, {1: b[2:]})
    torch.testing.assert_close(ctx.logits, reference_logits(ref, prompt + b)[-4:], rtol=0, atol=ATOL)
    _decode(ctx, {0: [1]})
    torch.testing.assert_close(ctx.logits[-1], reference_logits(ref, prompt + a + [1])[-1], rtol=0, atol=ATOL)


def test_state_saved_and_restored_into_another_sequence(loaded) -> None:
    ref, model = loaded
    prompt, cont = _prompt(10, 7), _prompt(5, 8)
    ctx = rsmem.Context(model, n_seq_max=4)
    _decode(ctx, {0: prompt})
    blob = ctx.state_seq_get_data(0)
    other = rsmem.Context(model, n_seq_max=4)
    other.state_seq_set_data(blob, 3)
    _decode(other, {3: cont})
    torch.testing.assert_close(other.logits, reference_logits(ref, prompt + cont)[-5:], rtol=0, atol=ATOL)


def test_bf16_compute_stays_close(hf_model) -> None:
    arch, ref, folder = hf_model
    model = rsmem.load_model(folder, dtype=torch.bfloat16)
    toks = _prompt(20, 9)
    ctx = rsmem.Context(model, n_seq_max=1)
    _decode(ctx, {0: toks})
    want = reference_logits(ref, toks)
    assert (ctx.logits - want).abs().max() < 0.05 * want.abs().max()
