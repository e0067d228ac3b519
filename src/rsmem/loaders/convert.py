"""Write an HF Mamba / Mamba-2 folder (or a hybrid's: :mod:`rsmem.loaders.hybrid.convert`) as GGUF the way
llama.cpp's ``convert_hf_to_gguf.py`` does: the same keys, tensor names, transforms, vocabulary padding and
per-tensor types."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from rsmem.loaders.hf import read_hf
from rsmem.loaders.hybrid.convert import hybrid_gguf_tensors, write_hybrid_hparams
from rsmem.loaders.quantize import convert_then_quantize, quantize_types
from rsmem.loaders.rwkv.convert import convert_rwkv7_hf_to_gguf
from rsmem.loaders.rwkv.hf import is_rwkv7_folder
from rsmem.loaders.tensors import ModelTensors, T, tensor_name
from rsmem.models.mamba.mamba1 import MambaConfig

Q = gguf.GGMLQuantizationType
OUTTYPES = {
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# llama.cpp's converter pads the vocabulary to these multiples (``pad_vocab_size_multiple``)
VOCAB_PAD = {"mamba": 8, "mamba2": 16}
CONTEXT_LENGTH = 2**20  # what llama.cpp writes for SSMs: no limit from positions
# kept float32 whatever the outtype, as llama.cpp does
F32_KINDS = ("ssm_a", "ssm_d", "ssm_conv1d.weight", "ssm_norm.weight", "shortconv.conv.weight")


def convert_hf_to_gguf(
    hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], outtype: str = "f32"
) -> Path:
    """Convert ``hf_dir`` to a GGUF file at ``out_path`` with matrices in ``outtype``; returns the path.
    f32, f16, bf16 and q8_0 are written as llama.cpp's converter writes them; the other types of
    ``rsmem quantize`` (q4_k_m, ...) by converting to f32 and quantizing that (``loaders/quantize.py``)."""
    if outtype not in OUTTYPES:
        if outtype in quantize_types():
            return convert_then_quantize(
                lambda tmp: convert_hf_to_gguf(hf_dir, tmp, "f32"), out_path, outtype
            )
        raise ValueError(f"outtype must be one of {quantize_types()}, got {outtype!r}")
    if is_rwkv7_folder(hf_dir):  # llama.cpp's RWKV layout: loaders/rwkv/convert.py
        return convert_rwkv7_hf_to_gguf(hf_dir, out_path, outtype)
    ckpt = read_hf(hf_dir)
    hybrid = ckpt.arch not in VOCAB_PAD  # lfm2, nemotron_h: loaders/hybrid/convert.py
    ckpt = ckpt if hybrid else _pad_vocab(ckpt)
    qtype, file_type = OUTTYPES[outtype]
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(out_path, ckpt.arch)
    (write_hybrid_hparams if hybrid else _write_hparams)(writer, ckpt, file_type)
    if ckpt.tokenizer is not None:
        _write_tokenizer(writer, ckpt)
    for name, t in (hybrid_gguf_tensors(ckpt) if hybrid else ckpt.tensors).items():
        data, dtype = _encode(name, t.float().numpy(), qtype)
        writer.add_tensor(name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _pad_vocab(ckpt: ModelTensors) -> ModelTensors:
    """Pad the embedding (and output) with zero rows, and the vocabulary with ``[PAD{i}]`` tokens."""
    mult = VOCAB_PAD[ckpt.arch]
    n_vocab = -(ckpt.config.n_vocab // -mult) * mult
    if n_vocab != ckpt.config.n_vocab:
        for kind in (T.TOKEN_EMBD, T.OUTPUT):
            name = tensor_name(kind)
            if name in ckpt.tensors:
                t = ckpt.tensors[name]
                ckpt.tensors[name] = torch.cat([t, t.new_zeros(n_vocab - t.shape[0], t.shape[1])])
    if ckpt.tokenizer is not None:
        ckpt.tokenizer = ckpt.tokenizer.padded(n_vocab)
    return ckpt


def _write_hparams(w: gguf.GGUFWriter, ckpt: ModelTensors, file_type: gguf.LlamaFileType) -> None:
    cfg = ckpt.config
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg.n_layer)
    w.add_ssm_conv_kernel(cfg.d_conv)
    w.add_ssm_inner_size(cfg.d_inner)
    w.add_ssm_state_size(cfg.d_state)
    if isinstance(cfg, MambaConfig):
        w.add_ssm_time_step_rank(cfg.dt_rank)
        w.add_ssm_dt_b_c_rms(False)
    else:
        w.add_ssm_time_step_rank(cfg.n_head)
        w.add_ssm_group_count(cfg.n_group)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(w: gguf.GGUFWriter, ckpt: ModelTensors) -> None:
    tok = ckpt.tokenizer
    assert tok is not None
    w.add_tokenizer_model(tok.model)
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    for value, add in (
        (tok.bos_id, w.add_bos_token_id),
        (tok.eos_id, w.add_eos_token_id),
        (tok.pad_id, w.add_pad_token_id),
    ):
        if value is not None:
            add(int(value))


def _encode(name: str, arr: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """The tensor's stored type by llama.cpp's rules: vectors and SSM parameters stay F32; Q8_0 needs rows
    that are a multiple of its 32-wide blocks, else the tensor falls back to F16."""
    if qtype == Q.F32 or arr.ndim == 1 or name.endswith(F32_KINDS):
        return arr.astype(np.float32), Q.F32
    if qtype == Q.Q8_0 and arr.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] != 0:
        qtype = Q.F16
    if qtype == Q.F16:
        return arr.astype(np.float16), Q.F16
    return gguf.quants.quantize(arr, qtype), qtype
