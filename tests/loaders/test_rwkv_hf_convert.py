"""Hugging Face RWKV-7 folders in the layouts llama.cpp's converter reads (its ``Rwkv7Model``): fla-hub's
(``RWKV7ForCausalLM``: ``attn.r_proj``, ``w_lora.lora.0``, ``g_norm`` ...) and the BlinkDL-named one, written
here from a random BlinkDL checkpoint. ``rsmem convert`` of the folder gives the tensors and keys of the
``.pth``'s conversion, and the same logits as the ``.pth`` read directly."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import rsmem
from helpers.rwkv_reference import random_rwkv7
from rsmem import Batch, Context
from rsmem.cli import main
from rsmem.loaders import convert_blink_to_gguf

PROMPT = [72, 102, 109, 109, 112, 33, 120, 112, 115, 109, 101, 257, 258, 290]
N_EMBD, N_LAYER, N_VOCAB, LORA = 128, 2, 300, 32
VOCAB_LINES = "".join(f"{b + 1} {bytes([b])!r} 1\n" for b in range(256))  # a World vocabulary of the bytes


def fla_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fla-hub's names and shapes (``fla.models.rwkv7``): low-rank ``nn.Linear`` weights ``[out, in]``, the
    ``w0/a0/v0`` as the second linear's bias, 1-D vectors."""
    out = {
        "model.embeddings.weight": sd["emb.weight"],
        "model.layers.0.pre_norm.weight": sd["blocks.0.ln0.weight"],
        "model.layers.0.pre_norm.bias": sd["blocks.0.ln0.bias"],
        "model.norm.weight": sd["ln_out.weight"],
        "model.norm.bias": sd["ln_out.bias"],
        "lm_head.weight": sd["head.weight"],
    }
    for b in range(N_LAYER):
        p, q = f"blocks.{b}.", f"model.layers.{b}."
        for src, dst in (("ln1", "attn_norm"), ("ln2", "ffn_norm"), ("att.ln_x", "attn.g_norm")):
            for s in ("weight", "bias"):
                out[f"{q}{dst}.{s}"] = sd[f"{p}{src}.{s}"]
        for x in "rwkvag":
            out[f"{q}attn.x_{x}"] = sd[f"{p}att.x_{x}"]  # [1, 1, C], as fla holds them
        for v in ("k_k", "k_a"):
            out[f"{q}attn.{v}"] = sd[f"{p}att.{v}"].flatten()
        out[f"{q}attn.r_k"] = sd[f"{p}att.r_k"]
        for src, dst in (
            ("receptance", "r_proj"),
            ("key", "k_proj"),
            ("value", "v_proj"),
            ("output", "o_proj"),
        ):
            out[f"{q}attn.{dst}.weight"] = sd[f"{p}att.{src}.weight"]
        for lo in "wavg":  # layer 0's v_lora is a dummy llama.cpp's converter drops
            out[f"{q}attn.{lo}_lora.lora.0.weight"] = sd[f"{p}att.{lo}1"].t().contiguous()
            out[f"{q}attn.{lo}_lora.lora.2.weight"] = sd[f"{p}att.{lo}2"].t().contiguous()
            if lo != "g":
                out[f"{q}attn.{lo}_lora.lora.2.bias"] = sd[f"{p}att.{lo}0"].flatten()
        out[f"{q}ffn.x_k"] = sd[f"{p}ffn.x_k"].flatten()
        out[f"{q}ffn.key.weight"] = sd[f"{p}ffn.key.weight"]
        out[f"{q}ffn.value.weight"] = sd[f"{p}ffn.value.weight"]
    return out


def blink_named_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The other layout llama.cpp's converter reads: BlinkDL's names under ``model.`` (``blocks`` ->
    ``layers``, ``att`` -> ``attention``, ``ffn`` -> ``feed_forward``), BlinkDL's shapes, lerps stacked."""
    out = {}
    for k, t in sd.items():
        if k.startswith("blocks.") and ".att.x_" in k:
            continue
        name = {"emb.weight": "model.embeddings.weight", "head.weight": "lm_head.weight"}.get(k)
        if name is None:
            name = "model." + k.replace("blocks", "layers").replace(".att.", ".attention.")
            name = name.replace(".ffn.", ".feed_forward.").replace("ln0", "pre_norm")
        out[name] = t
    for b in range(N_LAYER):  # the fused form: x_x [6, 1, 1, C] (r, w, k, v, a, g)
        out[f"model.layers.{b}.attention.x_x"] = torch.stack([sd[f"blocks.{b}.att.x_{x}"] for x in "rwkvag"])
    return out


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, object]) -> Path:
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "rwkv_vocab_v20230424.txt").write_text(VOCAB_LINES, encoding="utf-8")
    return folder


FLA_CONFIG = {
    "architectures": ["RWKV7ForCausalLM"],
    "model_type": "rwkv7",
    "hidden_size": N_EMBD,
    "head_dim": 64,
    "num_hidden_layers": N_LAYER,
    "intermediate_size": 4 * N_EMBD,
    "norm_eps": 1e-5,
    "decay_low_rank_dim": LORA,
    "a_low_rank_dim": LORA,
    "v_low_rank_dim": LORA,
    "gate_low_rank_dim": LORA,
    "vocab_size": N_VOCAB,
}
BLINK_CONFIG = {  # the keys llama.cpp's converter tries first
    "architectures": ["Rwkv7ForCausalLM"],
    "head_size": 64,
    "layer_norm_epsilon": 1e-5,
    "hidden_size": N_EMBD,
    "num_hidden_layers": N_LAYER,
    "intermediate_size": None,
    "lora_rank_decay": None,
    "lora_rank_iclr": None,
    "lora_rank_value_residual_mix": None,
    "lora_rank_gate": None,
    "vocab_size": N_VOCAB,
}


def logits(model) -> torch.Tensor:
    ctx = Context(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    return ctx.logits


def gguf_contents(path: Path) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: np.array(t.data) for t in reader.tensors}


@pytest.mark.parametrize("layout", ["fla", "blink"])
def test_hf_rwkv7_folder_converts_as_the_pth(layout: str, tmp_path: Path) -> None:
    sd = random_rwkv7(N_EMBD, N_LAYER, N_VOCAB, seed=21, d_ff=4 * N_EMBD)
    pth = tmp_path / "model.pth"
    torch.save(sd, pth)
    (tmp_path / "vocab.txt").write_text(VOCAB_LINES, encoding="utf-8")
    want_fields, want_tensors = gguf_contents(
        convert_blink_to_gguf(pth, tmp_path / "pth.gguf", "f32", tmp_path / "vocab.txt")
    )
    tensors, config = (
        (fla_tensors(sd), FLA_CONFIG) if layout == "fla" else (blink_named_tensors(sd), BLINK_CONFIG)
    )
    folder = write_folder(tmp_path / "hf", tensors, config)
    out = tmp_path / "hf.gguf"
    assert main(["convert", str(folder), str(out), "--outtype", "f32"]) == 0
    fields, got = gguf_contents(out)
    assert fields == want_fields
    assert got.keys() == want_tensors.keys()
    for name, t in want_tensors.items():
        np.testing.assert_array_equal(got[name], t, err_msg=name)
    want = logits(rsmem.load_model(pth))
    loaded = rsmem.load_model(out)
    assert loaded.arch == "rwkv7" and loaded.tokenizer is not None
    torch.testing.assert_close(logits(loaded), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits(rsmem.load_model(folder)), want, rtol=0, atol=1e-6)  # read directly
