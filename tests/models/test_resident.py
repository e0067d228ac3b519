"""Each weight held once: the bytes a loaded model references against its file's tensor bytes, the packed
twins' opt-out (``RSMEM_PACKED_TWINS=0``: the same logits, no second copy) and what loading a model and
generating a few tokens add to a fresh process's resident memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

import rsmem
from rsmem import hugepages
from rsmem.loaders import build_model, read_tensors
from rsmem.models.mamba.mamba1 import MambaConfig
from rsmem.models.mamba.mamba2 import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba, random_mamba2
from rsmem.models.ops.quantized import QuantMatrix
from rsmem.models.step.packed import packing_enabled

needs_packing = pytest.mark.skipif(not packing_enabled(), reason="oneDNN packing is not available here")


def held_bytes(model: Any) -> tuple[int, int]:
    """``(plain, packed)``: the bytes of the distinct storages of the tensors ``model`` references (a view
    counts its whole storage once), and of its oneDNN packed tensors (whose storage is opaque)."""
    storages: dict[int, int] = {}
    packed: dict[int, int] = {}
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_mkldnn:
                packed[id(obj)] = obj.numel() * obj.element_size()
            else:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, QuantMatrix):
            walk(obj.blocks)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, list | tuple):
            for item in obj:
                walk(item)
        elif type(obj).__module__.startswith("rsmem."):
            for name in getattr(type(obj), "__slots__", ()):
                walk(getattr(obj, name, None))
            for value in getattr(obj, "__dict__", {}).values():
                walk(value)

    walk(model)
    return sum(storages.values()), sum(packed.values())


def tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


@pytest.fixture(scope="module")
def mamba_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~30 MB f32 Mamba GGUF (above the size from which matrices move onto huge pages)."""
    from transformers import MambaConfig as HfMambaConfig
    from transformers import MambaForCausalLM

    folder = tmp_path_factory.mktemp("resident")
    torch.manual_seed(0)
    cfg = HfMambaConfig(
        vocab_size=4096, hidden_size=384, num_hidden_layers=6, state_size=16, time_step_rank=24
    )
    MambaForCausalLM(cfg).save_pretrained(folder / "hf")
    return Path(rsmem.convert(folder / "hf", folder / "mamba-f32.gguf", "f32"))


@needs_packing
@pytest.mark.parametrize("twins", ["1", "0"])
def test_loaded_model_holds_each_weight_once(
    mamba_file: Path, twins: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RSMEM_PACKED_TWINS", twins)
    model = rsmem.load_model(mamba_file, compile=False)
    plain, packed = held_bytes(model)
    want = tensor_bytes(mamba_file)
    # the file's tensors once (huge-page arenas add their alignment: at most one 2 MiB page each)
    assert want <= plain <= want * 1.02 + (4 << 20), (plain, want)
    if twins == "0":
        assert packed == 0
    else:  # a packed copy of every float32 matrix: the tied head's (the embedding's) among them
        assert 0.9 * want <= packed <= want, (packed, want)


def _decode_logits(model: Any) -> list[torch.Tensor]:
    """Logits of a 40-token prompt, then of three steps of 20 sequences and one of 2."""
    ctx = rsmem.Context(model, n_seq_max=20)
    prompt = [(7 * i) % 250 + 1 for i in range(40)]
    ctx.decode(rsmem.Batch(prompt, logits=[True] * len(prompt)))
    out = [ctx.logits.clone()]
    seqs = list(range(1, 20))
    ctx.decode(rsmem.Batch([s + 3 for s in seqs], seq_ids=[[s] for s in seqs], logits=[True] * len(seqs)))
    for step in range(3):
        n = 20 if step < 2 else 2
        batch = rsmem.Batch(
            [(step * 31 + s) % 250 + 1 for s in range(n)],
            pos=[40 + step if s == 0 else 1 + step for s in range(n)],
            seq_ids=[[s] for s in range(n)],
            logits=[True] * n,
        )
        ctx.decode(batch)
        out.append(ctx.logits.clone())
    return out


@needs_packing
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_without_twins_the_logits_are_the_same(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's product with the plain matrix gives the packed twin's values (it reorders the same way):
    prefill and decode of up to 20 sequences match bit for bit."""
    if arch == "mamba":
        config: Any = MambaConfig(
            d_model=128, n_layer=2, n_vocab=256, d_state=16, d_conv=4, d_inner=256, dt_rank=8, eps=1e-5
        )
        build: Any = random_mamba
    else:
        config = Mamba2Config(
            d_model=128, n_layer=2, n_vocab=256, d_state=32, d_conv=4, d_inner=256, n_head=8, n_group=1,
            eps=1e-5,
        )  # fmt: skip
        build = random_mamba2
    results = []
    for twins in ("1", "0"):
        monkeypatch.setenv("RSMEM_PACKED_TWINS", twins)
        model = build(config)
        model.set_compile(False)
        assert held_bytes(model)[1] > 0 if twins == "1" else held_bytes(model)[1] == 0
        results.append(_decode_logits(model))
    for with_twins, without in zip(*results):
        assert torch.equal(with_twins, without)


# One process: RSS (kB) after the imports, after loading argv[1], and after 8 generated tokens.
CHILD = r"""
import json, sys
def rss():
    f = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            f[key] = int(value.split()[0]) * 1024
    return f
import rsmem, torch
stages = [rss()]
model = rsmem.load_model(sys.argv[1])
stages.append(rss())
ctx = rsmem.Context(model)
ctx.decode(rsmem.Batch([1, 2, 3, 4, 5, 6, 7, 8], logits=[False] * 7 + [True]))
for i in range(8):
    ctx.decode(rsmem.Batch([int(ctx.get_logits(-1).argmax())], pos=[8 + i], seq_ids=[[0]], logits=[True]))
stages.append(rss())
print(json.dumps(stages))
"""


@needs_packing
def test_loading_without_twins_adds_about_the_file(mamba_file: Path) -> None:
    """What loading and 8 tokens add to a fresh process: about the file's bytes without the packed twins
    (the bound is generous: the machine's other processes do not move a process's own RSS, but the
    kernels' first call, the state and the allocator's arenas add their part)."""
    env = {"RSMEM_PACKED_TWINS": "0", "RSMEM_COMPILE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(mamba_file)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    imported, loaded, generated = json.loads(out.stdout.strip().splitlines()[-1])
    size = mamba_file.stat().st_size
    # anonymous memory only: the libraries' pages a first decode touches (torch's, the kernels') are file
    # pages, and how many depends on what earlier processes left in the page cache
    libraries = generated["RssFile"] - imported["RssFile"]
    # with the packed twins the weights are held twice: over these bounds
    assert loaded["RssAnon"] - imported["RssAnon"] < 1.25 * size + (10 << 20), (loaded, imported, size)
    assert generated["RssAnon"] - imported["RssAnon"] < 1.25 * size + (30 << 20), (generated, imported, size)
    # the highest RSS, loading included, less the libraries' pages: the loader's copy and the model's never
    # both held, nor the file's pages kept mapped beside the copies
    peak = generated["VmHWM"] - imported["VmRSS"] - max(libraries, 0)
    assert peak < 1.5 * size + (22 << 20), (generated, imported, size)


@needs_packing
def test_float32_matrices_are_read_onto_huge_pages(mamba_file: Path) -> None:
    """load_model reads a Mamba file's float32 matrices straight into the huge-page arena the model keeps
    (no second copy while it loads), with the logits of a model that moved the loader's copies there."""
    if not hugepages._enabled():
        pytest.skip("no transparent huge pages here (or RSMEM_HUGEPAGES=0)")
    model = rsmem.load_model(mamba_file, compile=False)
    ckpt = read_tensors(mamba_file)  # plain copies: the model moves them onto its own arena
    assert not hugepages.on_huge_pages(ckpt.tensors["token_embd.weight"])
    moved = build_model(ckpt, torch.float32, False)
    for m in (model, moved):
        assert hugepages.on_huge_pages(m.embedding)
        assert all(hugepages.on_huge_pages(layer.in_proj) for layer in m.layers)
    assert model.embedding.untyped_storage().data_ptr() != moved.embedding.untyped_storage().data_ptr()
    for a, b in zip(_decode_logits(model), _decode_logits(moved), strict=True):
        assert torch.equal(a, b)
