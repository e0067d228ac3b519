"""What ``rsmem convert`` writes for an HF hybrid folder (``lfm2``, ``nemotron_h``), as llama.cpp's
``convert_hf_to_gguf.py`` writes it: the architecture's metadata keys (per-layer arrays where llama.cpp
writes them) and the tensors in llama.cpp's stored shapes (Nemotron-H's ``ssm_a``/``ssm_d`` ``[n_head, 1]``
and ``ssm_norm`` ``[n_group, d_inner / n_group]``). Hybrid vocabularies are not padded.

:func:`write_hybrid_hparams` and :func:`hybrid_gguf_tensors` are what :mod:`rsmem.loaders.convert` calls
for these architectures; the tokenizer and the tensor encoding are the converter's own.
"""

from __future__ import annotations

import gguf
import torch

from rsmem.loaders.hybrid.qwen35 import write_qwen35_hparams
from rsmem.loaders.tensors import ModelTensors, tensor_name
from rsmem.models.hybrid.lfm2 import Lfm2Config
from rsmem.models.hybrid.nemotron_h import NemotronHConfig
from rsmem.models.hybrid.qwen35 import Qwen35Config

T = gguf.MODEL_TENSOR
SSM_CONTEXT_LENGTH = 2**20  # what llama.cpp's converter writes for Nemotron-H (no limit from positions)


def write_hybrid_hparams(w: gguf.GGUFWriter, ckpt: ModelTensors, file_type: gguf.LlamaFileType) -> None:
    """The ``{arch}.*`` keys llama.cpp's converter writes, the file type, and ``add_bos_token`` false."""
    cfg: object = ckpt.config
    hf = ckpt.meta.get("hf_config")
    hf_config = hf if isinstance(hf, dict) else {}
    if isinstance(cfg, Lfm2Config):
        w.add_block_count(cfg.n_layer)
        w.add_context_length(int(hf_config.get("max_position_embeddings", cfg.n_ctx_train)))
        w.add_embedding_length(cfg.d_model)
        w.add_feed_forward_length(cfg.d_ff)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(list(cfg.n_head_kv))
        w.add_rope_freq_base(cfg.rope_base)
        w.add_layer_norm_rms_eps(cfg.eps)
        w.add_file_type(file_type)
        w.add_vocab_size(cfg.n_vocab)
        w.add_shortconv_l_cache(cfg.l_cache)
    elif isinstance(cfg, NemotronHConfig):
        w.add_block_count(cfg.n_layer)
        w.add_context_length(SSM_CONTEXT_LENGTH)
        w.add_embedding_length(cfg.d_model)
        w.add_feed_forward_length(list(cfg.d_ff))
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(list(cfg.n_head_kv))
        w.add_layer_norm_eps(cfg.eps)
        w.add_file_type(file_type)
        w.add_vocab_size(cfg.n_vocab)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_ssm_conv_kernel(cfg.d_conv)
        w.add_ssm_state_size(cfg.d_state)
        w.add_ssm_group_count(cfg.n_group)
        w.add_ssm_inner_size(cfg.d_inner)
        w.add_ssm_time_step_rank(cfg.n_ssm_head)
        w.add_rope_scaling_finetuned(False)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    elif isinstance(cfg, Qwen35Config):
        write_qwen35_hparams(w, cfg, file_type, hf_config)
    else:
        raise ValueError(f"not a hybrid checkpoint: {ckpt.arch}")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_add_bos_token(False)


def hybrid_gguf_tensors(ckpt: ModelTensors) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in the shapes llama.cpp's converter stores (numpy order)."""
    cfg: object = ckpt.config
    if not isinstance(cfg, NemotronHConfig):
        return dict(ckpt.tensors)
    out = {}
    for name, t in ckpt.tensors.items():
        if name.endswith((".ssm_a", ".ssm_d")):
            t = t.reshape(-1, 1)
        elif name.endswith(tensor_name(T.SSM_NORM, 0)[len("blk.0") :]):
            t = t.reshape(cfg.n_group, -1)
        out[name] = t
    return out
