"""LFM2 and Nemotron-H from Hugging Face folders against transformers 5.24 itself: random tiny models built
and saved by transformers, loaded by rsmem (llama.cpp's tensor transforms applied), logits compared for a
whole prompt, token by token, four sequences in one batch and a fork (1e-4 of the logit scale).
Also: an HF folder gives exactly the tensors of llama.cpp's GGUF of it (the fixtures' models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.loaders import read_tensors

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 99, 3, 250, 7, 77, 123, 64, 31, 200, 11, 12]
FIXTURE_ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"  # copies of ../shared's


def _config(arch: str):
    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)  # fmt: skip
    if arch == "lfm2":
        return transformers.Lfm2Config(
            **common, conv_L_cache=3, layer_types=["conv", "full_attention", "conv", "full_attention"]
        )
    return transformers.NemotronHConfig(
        **common,
        layers_block_type=["mamba", "attention", "mamba", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        head_dim=16,
        chunk_size=4,
        time_step_min=1e-4,
    )


@pytest.fixture(scope="module", params=["lfm2", "nemotron_h"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, rsmem model loaded from its saved folder)."""
    arch = request.param
    torch.manual_seed(0)
    cfg = _config(arch)
    hf = (transformers.Lfm2ForCausalLM if arch == "lfm2" else transformers.NemotronHForCausalLM)(cfg).eval()
    with torch.no_grad():  # every parameter varies (norm weights are ones at init)
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(folder)
    return hf, rsmem.load_model(folder)


def _ref(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    assert err < 1e-4 * want.abs().max().item(), err


def test_whole_prompt_and_token_by_token(pair) -> None:
    hf, model = pair
    want = _ref(hf, PROMPT)
    ctx = Context(model, n_ctx=256)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    _close(ctx.logits, want)
    ctx = Context(model, n_ctx=256)
    rows = []
    for t in PROMPT:
        ctx.decode(Batch([t]))
        rows.append(ctx.logits[0].clone())
    _close(torch.stack(rows), want)


@pytest.mark.parametrize("unified", [False, True])
def test_four_sequences_and_a_fork(pair, unified: bool) -> None:
    hf, model = pair
    ctx = Context(model, n_seq_max=5, n_ctx=5 * 256, kv_unified=unified, n_ubatch=6)
    prompts = {0: PROMPT, 1: PROMPT[3:9], 2: PROMPT[::-1], 3: PROMPT[:5]}
    ctx.decode(Batch.from_sequences(prompts, all_logits=True))
    row = 0
    for p in prompts.values():
        _close(ctx.logits[row : row + len(p)], _ref(hf, p))
        row += len(p)
    ctx.memory.seq_cp(3, 4)
    ctx.decode(Batch.from_sequences({4: [60, 61], 3: [70]}, all_logits=True))
    _close(ctx.logits[:2], _ref(hf, [*PROMPT[:5], 60, 61])[-2:])
    _close(ctx.logits[2:], _ref(hf, [*PROMPT[:5], 70])[-1:])


@pytest.mark.parametrize("arch", ["lfm2", "nemotron_h"])
def test_hf_folder_gives_llamacpps_tensors(arch: str) -> None:
    hf = read_tensors(FIXTURE_ROOT / arch / "hf")
    gguf = read_tensors(
        Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / arch / "model-f32.gguf"
    )
    assert set(hf.tensors) == set(gguf.tensors)
    for name, t in gguf.tensors.items():
        assert torch.equal(hf.tensors[name].reshape(t.shape), t), name
