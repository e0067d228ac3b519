"""Hugging Face RWKV-7 folders, in the layouts llama.cpp's converter reads (its ``Rwkv7Model``): fla-hub's
(``RWKV7ForCausalLM``: ``model.layers.N.attn.r_proj``, ``w_lora.lora.0`` ...) and the BlinkDL-named one
(``model.layers.N.attention.receptance``, ``w1`` ...), mapped to BlinkDL ``.pth`` names and then read as a
``.pth`` is (:func:`~rsmem.loaders.rwkv.build.rwkv7_from_blink`), so both give llama.cpp's tensors.

``is_rwkv7_folder(folder)``; ``read_hf_rwkv7(folder)`` -> :class:`ModelTensors` (with the World tokenizer when
the folder holds ``rwkv_vocab_v20230424.txt``, as llama.cpp's converter requires).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.build import rwkv7_from_blink
from rsmem.loaders.rwkv.vocab import world_vocabulary
from rsmem.loaders.tensors import ModelTensors

HF_ARCHS = ("Rwkv7ForCausalLM", "RWKV7ForCausalLM")
VOCAB_FILE = "rwkv_vocab_v20230424.txt"
# names after llama.cpp's unification (blocks -> layers, ffn -> feed_forward, attn -> attention, ...),
# without the "model.layers.N." prefix -> BlinkDL names without "blocks.N."
_LAYER = {
    "attention_norm.weight": "ln1.weight", "attention_norm.bias": "ln1.bias",
    "ln1.weight": "ln1.weight", "ln1.bias": "ln1.bias",
    "ln2.weight": "ln2.weight", "ln2.bias": "ln2.bias",
    "pre_norm.weight": "ln0.weight", "pre_norm.bias": "ln0.bias",
    "attention.r_proj.weight": "att.receptance.weight",
    "attention.receptance.weight": "att.receptance.weight",
    "attention.k_proj.weight": "att.key.weight", "attention.key.weight": "att.key.weight",
    "attention.v_proj.weight": "att.value.weight", "attention.value.weight": "att.value.weight",
    "attention.o_proj.weight": "att.output.weight", "attention.output.weight": "att.output.weight",
    "attention.ln_x.weight": "att.ln_x.weight", "attention.ln_x.bias": "att.ln_x.bias",
    "attention.k_k": "att.k_k", "attention.k_a": "att.k_a", "attention.r_k": "att.r_k",
    "feed_forward.x_k": "ffn.x_k",
    "feed_forward.key.weight": "ffn.key.weight", "feed_forward.value.weight": "ffn.value.weight",
}  # fmt: skip
_OUTER = {
    "model.embeddings.weight": "emb.weight",
    "model.pre_ln.weight": "blocks.0.ln0.weight",
    "model.pre_ln.bias": "blocks.0.ln0.bias",
    "model.norm.weight": "ln_out.weight",
    "model.norm.bias": "ln_out.bias",
    "model.ln_out.weight": "ln_out.weight",
    "model.ln_out.bias": "ln_out.bias",
    "lm_head.weight": "head.weight",
}
_LERPS = ("r", "w", "k", "v", "a", "g")


def is_rwkv7_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder``'s config.json names an RWKV-7 model (``model_type`` or ``architectures``)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return config.get("model_type") == "rwkv7" or any(
        a in HF_ARCHS for a in config.get("architectures") or ()
    )


def unified_name(name: str) -> str:
    """A tensor name as llama.cpp's ``Rwkv7Model.filter_tensors`` unifies it, the low-rank ``*_lora``
    matrices renamed as its ``modify_tensors`` does (``w_lora.lora.0.weight`` -> ``w1.weight``,
    ``lora.2.weight`` -> ``w2.weight``, ``lora.2.bias`` -> ``w0.weight``)."""
    name = name.replace("blocks", "layers").replace("ffn", "feed_forward")
    name = name.replace("self_attn", "attention").replace("attn", "attention").replace("time_mixer.", "")
    name = name.replace("feed_forward_norm", "ln2").replace("g_norm", "ln_x")
    name = name.replace("_lora.lora.0.weight", "1.weight").replace("_lora.lora.2.weight", "2.weight")
    return name.replace("_lora.lora.2.bias", "0.weight")


def blink_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The folder's tensors under BlinkDL names and shapes (low-rank matrices ``[in, out]``)."""
    names = {unified_name(n): n for n in tensors}
    fla = any(n != unified_name(n) and "_lora.lora" in n for n in tensors)  # fla's [out, in] low-rank
    out: dict[str, torch.Tensor] = {}
    for uname, src in names.items():
        t = tensors[src]
        if uname in _OUTER:
            out[_OUTER[uname]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", uname)
        if m is None:
            raise ModelFormatError(f"unexpected tensor {src!r} in an RWKV-7 folder")
        b, rest = int(m.group(1)), m.group(2)
        p = f"blocks.{b}."
        lora = re.fullmatch(r"attention\.([wavg])([012])(?:\.weight)?", rest)
        if rest in _LAYER:
            out[p + _LAYER[rest]] = t
        elif lora is not None:
            which, k = lora.groups()
            out[f"{p}att.{which}{k}"] = t.t() if fla and k != "0" else t
        elif rest == "attention.x_x":  # already stacked, r w k v a g
            for x, row in zip(_LERPS, t.reshape(len(_LERPS), -1), strict=True):
                out[f"{p}att.x_{x}"] = row
        elif (lerp := re.fullmatch(r"attention\.x_([rwkvag])", rest)) is not None:
            out[f"{p}att.x_{lerp.group(1)}"] = t
        else:
            raise ModelFormatError(f"unexpected tensor {src!r} in an RWKV-7 folder")
    if "head.weight" not in out and "emb.weight" in out:
        out["head.weight"] = out["emb.weight"]  # tied embeddings
    return out


def read_hf_rwkv7(folder: str | os.PathLike[str]) -> ModelTensors:
    """An HF RWKV-7 folder in llama.cpp's form (see the module)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    sd = blink_state_dict(tensors)
    head_size = config.get("head_size", config.get("head_dim"))
    if head_size is None:
        raise ModelFormatError(f"{folder}: config.json has neither head_size nor head_dim")
    for key in [k for k in sd if k.endswith("att.r_k")]:  # BlinkDL's [H, N]: the head count comes from it
        sd[key] = sd[key].reshape(-1, int(head_size))
    cfg, out = rwkv7_from_blink(sd)
    eps = config.get("layer_norm_epsilon", config.get("norm_eps"))
    if eps is not None:
        cfg = dataclasses.replace(cfg, eps=float(eps))
    vocab = folder / VOCAB_FILE
    tokenizer = world_vocabulary(vocab, cfg.n_vocab) if vocab.is_file() else None
    return ModelTensors(arch="rwkv7", config=cfg, tensors=out, tokenizer=tokenizer, source=str(folder))  # type: ignore[arg-type]
