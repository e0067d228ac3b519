"""llama.cpp's own logits and state files (tests/fixtures/llamacpp, see its README) reproduced by rsmem.

llama.cpp's f32 GGUF of each model is not in the repository (it holds the same weights as ``hf/``): the f32
model here is rsmem's conversion of ``hf/``, and :func:`test_converted_gguf_matches_llamacpp` pins its
tensors bit for bit to llama.cpp's file through a digest of that file's tensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import rsmem
from rsmem.loaders import convert_hf_to_gguf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
# _tensor_digest of llama.cpp's model-f32.gguf (convert_hf_to_gguf.py --outtype f32 of hf/), from
# ../shared/fixtures/llamacpp/{arch}/model-f32.gguf (see tests/fixtures/llamacpp/README.md)
LLAMACPP_F32_TENSORS = {
    "mamba": "168387adfdb5d40e08561e7104bae725f8cc4f73a7069cdf074b1dac6e96e92a",
    "mamba2": "808d30e9668a21fff00c3fc4ae2216090911133fb369e524db665c2adedd422d",
}

ARCHS = ["mamba", "mamba2"]
TYPES = ["f32", "bf16", "q8_0"]
# max |error| / max |logit|: f32 is exact up to rounding; bf16 weights and, for q8_0, llama.cpp's
# q8_0-quantised activations differ from rsmem's float32 activations by up to ~1e-2 relative
REL_TOL = {"f32": 1e-5, "bf16": 1e-2, "q8_0": 3e-2}
F32_ATOL = 1e-4


def _fixture(arch: str) -> dict:
    return json.loads((FIXTURES / arch / "fixture.json").read_text())


def _tensor_digest(path: Path) -> str:
    """sha256 over a GGUF's tensors in name order: name, ggml type, shape, then the raw data bytes."""
    h = hashlib.sha256()
    for t in sorted(gguf.GGUFReader(path).tensors, key=lambda t: t.name):
        h.update(f"{t.name} {t.tensor_type.name} {[int(d) for d in t.shape]}\n".encode())
        h.update(t.data.tobytes())
    return h.hexdigest()


def _gguf(arch: str, kind: str, tmp: Path) -> Path:
    """llama.cpp's GGUF of ``kind``; for f32 rsmem's conversion of ``hf/`` (pinned to llama.cpp's file by
    :func:`test_converted_gguf_matches_llamacpp`)."""
    if kind == "f32":
        return convert_hf_to_gguf(FIXTURES / arch / "hf", tmp / f"{arch}-f32.gguf", outtype="f32")
    return FIXTURES / arch / f"model-{kind}.gguf"


def _check(got: torch.Tensor, want: np.ndarray, kind: str) -> None:
    want_t = torch.from_numpy(want).float()
    err = (got - want_t).abs().max().item()
    if kind == "f32":
        assert err < F32_ATOL, err
    else:
        assert err < REL_TOL[kind] * want_t.abs().max().item(), err


def _prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    ctx = rsmem.Context(model, n_seq_max=4)
    ctx.decode(rsmem.Batch(prompt, seq_ids=[[0]] * len(prompt), logits=[True] * len(prompt)))
    return ctx.logits


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], object]:
    tmp = tmp_path_factory.mktemp("gguf")
    return {(a, t): rsmem.load_model(_gguf(a, t, tmp)) for a in ARCHS for t in TYPES}


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_prompt_logits(models, arch: str, kind: str) -> None:
    model = models[(arch, kind)]
    fx = _fixture(arch)
    assert model.n_vocab == fx["models"][kind]["n_vocab"]
    _check(_prompt_logits(model, fx["prompt"]), np.load(FIXTURES / arch / f"logits-prompt-{kind}.npy"), kind)


@pytest.mark.parametrize("dest", [0, 2])
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_restored_state_continues_like_llamacpp(models, arch: str, kind: str, dest: int) -> None:
    fx = _fixture(arch)
    ctx = rsmem.Context(models[(arch, kind)], n_seq_max=4)
    assert ctx.state_seq_load_file(FIXTURES / arch / f"state-seq0-{kind}.ggsq", dest) == fx["prompt"]
    got = []
    for tok in fx["continuation"]:
        ctx.decode(rsmem.Batch([tok], seq_ids=[[dest]], logits=[True]))
        got.append(ctx.get_logits(0))
    _check(torch.stack(got), np.load(FIXTURES / arch / f"logits-continuation-{kind}.npy"), kind)


@pytest.mark.parametrize("arch", ARCHS)
def test_state_blob_matches_llamacpp_rows(models, arch: str) -> None:
    """The state rsmem computes for the prompt is byte-layout-compatible with llama.cpp's blob."""
    fx = _fixture(arch)
    ctx = rsmem.Context(models[(arch, "f32")], n_seq_max=1)
    p = fx["prompt"]
    ctx.decode(rsmem.Batch(p, seq_ids=[[0]] * len(p)))
    ours, theirs = ctx.state_seq_get_data(0), (FIXTURES / arch / "state-seq0-f32.bin").read_bytes()
    assert len(ours) == len(theirs)
    header = 8 + 4 + 4 + 4 + 4 + 4  # magic + seq, cell_count, pos, n_seq_id, s_trans, n_layer
    assert ours[:header] == theirs[:header]
    offset = header
    for _ in range(2 * models[(arch, "f32")].n_layer):  # r rows of every layer, then s rows
        assert ours[offset : offset + 12] == theirs[offset : offset + 12]  # ggml type, row bytes
        n = int.from_bytes(theirs[offset + 4 : offset + 12], "little")
        offset += 12
        a = np.frombuffer(ours[offset : offset + n], dtype="<f4")
        b = np.frombuffer(theirs[offset : offset + n], dtype="<f4")
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        offset += n
    assert offset == len(theirs)
    ctx2 = rsmem.Context(models[(arch, "f32")], n_seq_max=1)
    ctx2.state_seq_set_data(theirs, 0)
    for t in fx["continuation"]:
        ctx.decode(rsmem.Batch([t], seq_ids=[[0]]))
        ctx2.decode(rsmem.Batch([t], seq_ids=[[0]]))
        torch.testing.assert_close(ctx.logits, ctx2.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_matches_llamacpp(arch: str) -> None:
    fx = _fixture(arch)
    model = rsmem.load_model(FIXTURES / arch / "hf")
    _check(_prompt_logits(model, fx["prompt"]), np.load(FIXTURES / arch / "logits-prompt-f32.npy"), "f32")


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_gguf_matches_llamacpp(tmp_path: Path, arch: str, kind: str) -> None:
    fx = _fixture(arch)
    out = convert_hf_to_gguf(FIXTURES / arch / "hf", tmp_path / "m.gguf", outtype=kind)
    model = rsmem.load_model(out)
    want = np.load(FIXTURES / arch / f"logits-prompt-{kind}.npy")
    _check(_prompt_logits(model, fx["prompt"]), want, kind)
    if kind == "f32":  # the same names, types, shapes and bytes as llama.cpp's converter wrote
        assert _tensor_digest(out) == LLAMACPP_F32_TENSORS[arch]
        return
    # the tensors rsmem writes decode to the same values llama.cpp's converter wrote
    from rsmem.loaders import read_tensors

    ours, theirs = read_tensors(out), read_tensors(FIXTURES / arch / f"model-{kind}.gguf")
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name, t in theirs.tensors.items():
        assert ours.tensors[name].shape == t.shape, name
        torch.testing.assert_close(ours.tensors[name], t, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizers_from_gguf_and_hf_agree(arch: str) -> None:
    from rsmem.loaders import load_tokenizer

    text = "the quick brown fox says hello to the world"
    a = load_tokenizer(FIXTURES / arch / "model-bf16.gguf")  # llama.cpp's vocabulary metadata
    b = load_tokenizer(FIXTURES / arch / "hf")
    assert a is not None and b is not None
    ids = b.encode(text).ids
    assert a.encode(text).ids == ids
    assert a.decode(ids) == text


def test_sharded_hf_folder_loads_the_same(tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    src = FIXTURES / "mamba2" / "hf"
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / fname)
        weight_map |= dict.fromkeys(keys, fname)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    prompt = _fixture("mamba2")["prompt"]
    want = _prompt_logits(rsmem.load_model(src), prompt)
    torch.testing.assert_close(_prompt_logits(rsmem.load_model(tmp_path), prompt), want, rtol=0, atol=0)
