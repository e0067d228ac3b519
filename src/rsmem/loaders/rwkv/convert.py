"""BlinkDL RWKV checkpoints (the ``.pth`` files the official ``rwkv`` package loads) read into llama.cpp's
form, and written as GGUF with the keys, tensor names and layouts of llama.cpp's converter.

``read_blink(path, vocab=None)`` -> :class:`ModelTensors` (RWKV-7 or RWKV-6, told apart by their tensors);
``convert_blink_to_gguf(path, out, outtype, vocab)`` writes the GGUF; ``convert_rwkv7_hf_to_gguf(folder,
out, outtype)`` the same from a Hugging Face RWKV-7 folder (:mod:`rsmem.loaders.rwkv.hf`). ``vocab`` is the
World vocabulary file (``rwkv_vocab_v20230424.txt``: one ``id repr(token) length`` line per token), stored
as llama.cpp stores it: ``<s>`` (control) as token 0, the file's tokens, ``[PADn]`` up to the embedding's
rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import gguf
import numpy as np
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.build import rwkv7_from_blink
from rsmem.loaders.rwkv.rwkv6 import rwkv6_from_blink
from rsmem.loaders.rwkv.vocab import world_vocabulary
from rsmem.loaders.tensors import ModelTensors
from rsmem.models.rwkv.rwkv6 import Rwkv6Config
from rsmem.models.rwkv.rwkv7 import Rwkv7Config

Q = gguf.GGMLQuantizationType
OUTTYPES = {
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
EOT_ID = 261  # "\n\n": llama.cpp's converter marks it as the end of a turn


def is_blink_checkpoint(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix == ".pth" and Path(path).is_file()


def read_blink(path: str | os.PathLike[str], vocab: str | os.PathLike[str] | None = None) -> ModelTensors:
    """A BlinkDL ``.pth`` state dict in llama.cpp's form; with ``vocab``, its World tokenizer."""
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types on files that are not state dicts
        raise ModelFormatError(
            f"{path}: not a loadable .pth checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(sd, dict) or "emb.weight" not in sd:
        raise ModelFormatError(f"{path}: not an RWKV checkpoint (no emb.weight)")
    if "blocks.0.att.r_k" in sd:
        arch, (config, tensors) = "rwkv7", rwkv7_from_blink(sd)
    elif "blocks.0.att.time_maa_x" in sd:
        arch, (config, tensors) = "rwkv6", rwkv6_from_blink(sd)  # type: ignore[assignment]
    else:
        raise ModelFormatError(f"{path}: an RWKV checkpoint of a version other than 6 or 7")
    tokenizer = None if vocab is None else world_vocabulary(vocab, config.n_vocab)
    return ModelTensors(arch=arch, config=config, tensors=tensors, tokenizer=tokenizer, source=str(path))  # type: ignore[arg-type]


def convert_blink_to_gguf(
    path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    outtype: str = "f32",
    vocab: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the ``.pth`` at ``path`` as GGUF at ``out_path``: matrices in ``outtype`` (``f32``, ``f16``,
    ``bf16``, ``q8_0``; vectors and stacked lerps stay F32, as llama.cpp keeps them); returns the path."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}")
    return write_rwkv_gguf(read_blink(path, vocab), out_path, outtype)


def convert_rwkv7_hf_to_gguf(
    folder: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str = "f32"
) -> Path:
    """:func:`convert_blink_to_gguf` for a Hugging Face RWKV-7 folder (:mod:`rsmem.loaders.rwkv.hf`): its
    World tokenizer when it holds ``rwkv_vocab_v20230424.txt``."""
    from rsmem.loaders.rwkv.hf import read_hf_rwkv7

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}")
    return write_rwkv_gguf(read_hf_rwkv7(folder), out_path, outtype)


def write_rwkv_gguf(ckpt: ModelTensors, out_path: str | os.PathLike[str], outtype: str) -> Path:
    """Write an RWKV checkpoint in llama.cpp's form as GGUF (see :func:`convert_blink_to_gguf`)."""
    qtype, file_type = OUTTYPES[outtype]
    out_path = Path(out_path)
    w = gguf.GGUFWriter(out_path, ckpt.arch)
    _write_hparams(w, ckpt, file_type)
    if ckpt.tokenizer is not None:
        tok = ckpt.tokenizer
        w.add_tokenizer_model("rwkv")
        w.add_token_list(tok.tokens)
        w.add_token_types(tok.token_types)
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
        if len(tok.tokens) > EOT_ID:
            w.add_eot_token_id(EOT_ID)
    for name, t in ckpt.tensors.items():
        data, dtype = _encode(t.float().numpy(), qtype)
        w.add_tensor(name, data, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _write_hparams(w: gguf.GGUFWriter, ckpt: ModelTensors, file_type: gguf.LlamaFileType) -> None:
    cfg = cast("Rwkv7Config | Rwkv6Config", ckpt.config)  # ModelTensors.config names the Mamba configs
    w.add_context_length(1048576)  # RWKV is not limited by positions
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_layer_norm_eps(cfg.eps)
    w.add_wkv_head_size(cfg.head_size)
    if isinstance(cfg, Rwkv6Config):
        w.add_rescale_every_n_layers(cfg.rescale_every_n_layers)
        w.add_time_mix_extra_dim(cfg.time_mix_extra_dim)
        w.add_time_decay_extra_dim(cfg.time_decay_extra_dim)
    else:
        w.add_decay_lora_rank(cfg.n_lora_decay)
        w.add_iclr_lora_rank(cfg.n_lora_iclr)
        w.add_value_residual_mix_lora_rank(cfg.n_lora_value_res_mix)
        w.add_gate_lora_rank(cfg.n_lora_gate)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(0)  # required by llama.cpp, unused
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _encode(arr: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """Matrices in ``qtype`` (Q8_0 needs rows that are a multiple of its 32-wide blocks, else F16); every
    tensor that is not a matrix stays F32."""
    if qtype == Q.F32 or arr.ndim != 2:
        return arr.astype(np.float32), Q.F32
    if qtype == Q.Q8_0 and arr.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] != 0:
        qtype = Q.F16
    if qtype == Q.F16:
        return arr.astype(np.float16), Q.F16
    return gguf.quants.quantize(arr, qtype), qtype
