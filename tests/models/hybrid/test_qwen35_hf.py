"""Qwen3.5 from Hugging Face folders against transformers 5.24 itself: a random tiny ``Qwen3_5ForCausalLM``
(2 key / 4 value heads, so the value heads' reorder matters; a prompt longer than one 64-token chunk) built
and saved by transformers, loaded by rsmem (llama.cpp's converter transforms applied), logits compared for a
whole prompt, token by token, in chunks, four sequences in one batch and a fork (1e-4 of the logit scale).
Also: the fixture's HF folder gives exactly the tensors of llama.cpp's GGUF of it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.loaders import read_tensors

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 4e-5  # as test_qwen35: this model's float32 rounding is large and moves with threads
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "qwen35"
PROMPT = [(5 + 37 * k) % 300 for k in range(80)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, rsmem model loaded from its saved folder)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
    )
    hf = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():  # every parameter varies (zero-centred norm weights are zeros at init)
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("qwen35")
    hf.save_pretrained(folder)
    return hf, rsmem.load_model(folder)


def _ref(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    assert err < 1e-4 * want.abs().max().item(), err


def test_whole_prompt_token_by_token_and_in_chunks(pair) -> None:
    hf, model = pair
    want = _ref(hf, PROMPT)
    ctx = Context(model, n_ctx=256)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    _close(ctx.logits, want)
    ctx = Context(model, n_ctx=256)
    rows = []
    for t in PROMPT[:20]:
        ctx.decode(Batch([t]))
        rows.append(ctx.logits[0].clone())
    _close(torch.stack(rows), want[:20])
    ctx = Context(model, n_ctx=256)
    rows, start = [], 0
    for n in (30, 1, 40, 9):
        part = PROMPT[start : start + n]
        ctx.decode(Batch(part, pos=list(range(start, start + n)), logits=[True] * n))
        rows.append(ctx.logits.clone())
        start += n
    _close(torch.cat(rows), want)


@pytest.mark.parametrize("unified", [False, True])
def test_four_sequences_and_a_fork(pair, unified: bool) -> None:
    hf, model = pair
    ctx = Context(model, n_seq_max=5, n_ctx=5 * 256, kv_unified=unified, n_ubatch=6)
    prompts = {0: PROMPT[:14], 1: PROMPT[3:9], 2: PROMPT[13::-1], 3: PROMPT[:5]}
    ctx.decode(Batch.from_sequences(prompts, all_logits=True))
    row = 0
    for p in prompts.values():
        _close(ctx.logits[row : row + len(p)], _ref(hf, p))
        row += len(p)
    ctx.memory.seq_cp(3, 4)
    ctx.decode(Batch.from_sequences({4: [60, 61], 3: [70]}, all_logits=True))
    _close(ctx.logits[:2], _ref(hf, [*PROMPT[:5], 60, 61])[-2:])
    _close(ctx.logits[2:], _ref(hf, [*PROMPT[:5], 70])[-1:])
    ctx.decode(Batch.from_sequences({s: [71] for s in range(5)}))  # one token of five sequences at once
    for i, (s, p) in enumerate({**prompts, 4: [*PROMPT[:5], 60, 61]}.items()):
        tokens = [*p, 70] if s == 3 else p
        _close(ctx.get_logits(i), _ref(hf, [*tokens, 71])[-1])


def test_hf_folder_gives_llamacpps_tensors() -> None:
    hf = read_tensors(FIXTURE / "hf")
    gguf = read_tensors(FIXTURE / "model-f32.gguf")
    assert set(hf.tensors) == set(gguf.tensors)
    for name, t in gguf.tensors.items():
        assert torch.equal(hf.tensors[name].reshape(t.shape), t), name
    assert abs(hf.config.eps - gguf.config.eps) < 1e-12  # the GGUF stores it as float32
    assert replace(hf.config, eps=gguf.config.eps) == gguf.config


def test_a_conditional_generation_folder_loads_its_language_model(tmp_path: Path) -> None:
    """``Qwen3_5ForConditionalGeneration`` folders (Qwen's releases): hyperparameters under ``text_config``,
    the language model's tensors under ``model.language_model.``, vision and MTP tensors beside them."""
    from safetensors.torch import load_file, save_file

    raw = load_file(FIXTURE / "hf" / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in raw.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    text = json.loads((FIXTURE / "hf" / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    config["text_config"] = text
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((FIXTURE / "hf" / name).read_bytes())
    got, want = read_tensors(tmp_path), read_tensors(FIXTURE / "hf")
    assert got.config == want.config and set(got.tensors) == set(want.tensors)
    assert all(torch.equal(got.tensors[n], t) for n, t in want.tensors.items())


def test_convert_matches_llamacpps_converter(tmp_path: Path) -> None:
    """``rsmem convert`` of the fixture's HF folder: every ``qwen35.*`` key (in llama.cpp's order) and every
    tensor (name, type, shape, bytes) as llama.cpp's converter wrote them; the file loads and runs."""
    import gguf
    import numpy as np

    path = rsmem.convert(FIXTURE / "hf", tmp_path / "m.gguf", "f32")
    mine, ref = gguf.GGUFReader(path), gguf.GGUFReader(FIXTURE / "model-f32.gguf")

    def arch_fields(r: gguf.GGUFReader) -> list[tuple[str, object]]:
        keys = [k for k in r.fields if k.startswith("qwen35.") or k == "general.file_type"]
        return [(k, r.fields[k].contents()) for k in keys]

    assert arch_fields(mine) == arch_fields(ref)
    got, want = {t.name: t for t in mine.tensors}, {t.name: t for t in ref.tensors}
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert (g.tensor_type, list(g.shape)) == (t.tensor_type, list(t.shape)), name
        assert np.array_equal(np.asarray(g.data), np.asarray(t.data)), name
    ctx = Context(rsmem.load_model(path), n_ctx=256)
    prompt = [5, 17, 42, 99, 3, 250, 7, 77, 123, 64, 31, 200]
    ctx.decode(Batch(prompt, logits=[True] * len(prompt)))
    want_logits = torch.from_numpy(np.load(FIXTURE / "logits-prompt-f32.npy"))
    assert (ctx.logits - want_logits).abs().max().item() < LOGITS_ATOL
