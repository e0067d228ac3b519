"""The Mamba family in llama.cpp's form: Mamba's and Mamba-2's GGUF hyperparameters, and their weights by
tensor name (``config_from_gguf``, ``build_mamba``: the family's entries in :mod:`rsmem.loaders.registry`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.hparams import Hparams, consistent
from rsmem.loaders.tensors import ModelTensors, T, tensor_name
from rsmem.models.mamba.mamba1 import MambaConfig, MambaLayer, MambaModel, MambaWeights
from rsmem.models.mamba.mamba2 import Mamba2Config, Mamba2Layer, Mamba2Model, Mamba2Weights
from rsmem.models.ops.quantized import Matrix
from rsmem.models.step.compiled import CompileSetting

MAMBA_ARCHS = ("mamba", "mamba2")


def config_from_gguf(
    arch: str, key: Callable[[str], object], n_vocab: int, optional: Callable[[str], object | None]
) -> MambaConfig | Mamba2Config:
    """Mamba's or Mamba-2's hyperparameters, each in its range (see ``hparams.py``)."""
    keys = Hparams(arch, key, optional)
    with consistent():
        common = {
            "d_model": keys.count("embedding_length"),
            "n_layer": keys.count("block_count"),
            "n_vocab": n_vocab,
            "d_state": keys.count("ssm.state_size"),
            "d_conv": keys.count("ssm.conv_kernel"),
            "d_inner": keys.count("ssm.inner_size"),
        }
        eps = keys.epsilon("attention.layer_norm_rms_epsilon")
        if arch == "mamba":
            return MambaConfig(**common, eps=eps, dt_rank=keys.count("ssm.time_step_rank"))
        n_head, n_group = keys.count("ssm.time_step_rank"), keys.count("ssm.group_count")
        keys.divides("ssm.time_step_rank", n_head, "ssm.inner_size", common["d_inner"])
        keys.divides("ssm.group_count", n_group, "ssm.time_step_rank", n_head)
        return Mamba2Config(**common, eps=eps, n_head=n_head, n_group=n_group)


def build_mamba(
    ckpt: ModelTensors, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
) -> MambaModel | Mamba2Model:
    """The model of ``ckpt`` (``dtype``: its matrices'; ``compile``: see the models' ``set_compile``)."""
    if ckpt.arch == "mamba":
        return MambaModel(ckpt.config, _mamba_weights(ckpt), dtype=dtype, compile=compile)  # type: ignore[arg-type]
    if ckpt.arch == "mamba2":
        return Mamba2Model(ckpt.config, _mamba2_weights(ckpt), dtype=dtype, compile=compile)  # type: ignore[arg-type]
    raise ModelFormatError(f"{ckpt.source}: unsupported architecture {ckpt.arch!r}")


def _embeddings(ckpt: ModelTensors) -> tuple[Matrix, torch.Tensor, Matrix]:
    cfg = ckpt.config
    emb = ckpt.get_matrix(tensor_name(T.TOKEN_EMBD), (cfg.n_vocab, cfg.d_model))
    norm_f = ckpt.get(tensor_name(T.OUTPUT_NORM), (cfg.d_model,))
    head_name = tensor_name(T.OUTPUT)
    head = ckpt.get_matrix(head_name, (cfg.n_vocab, cfg.d_model)) if head_name in ckpt else emb
    return emb, norm_f, head


def _mamba_weights(ckpt: ModelTensors) -> MambaWeights:
    cfg = ckpt.config
    assert isinstance(cfg, MambaConfig)
    d, di, n, r, k = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.dt_rank, cfg.d_conv
    layers = []
    for b in range(cfg.n_layer):
        layers.append(
            MambaLayer(
                norm=ckpt.get(tensor_name(T.ATTN_NORM, b), (d,)),
                in_proj=ckpt.get_matrix(tensor_name(T.SSM_IN, b), (2 * di, d)),
                conv_weight=ckpt.get(tensor_name(T.SSM_CONV1D, b), (di, k)),
                conv_bias=ckpt.get(tensor_name(T.SSM_CONV1D, b, ".bias"), (di,)),
                x_proj=ckpt.get_matrix(tensor_name(T.SSM_X, b), (r + 2 * n, di)),
                dt_proj=ckpt.get(tensor_name(T.SSM_DT, b), (di, r)),
                dt_bias=ckpt.get(tensor_name(T.SSM_DT, b, ".bias"), (di,)),
                A=ckpt.get(tensor_name(T.SSM_A, b, ""), (di, n)),
                D=ckpt.get(tensor_name(T.SSM_D, b, ""), (di,)),
                out_proj=ckpt.get_matrix(tensor_name(T.SSM_OUT, b), (d, di)),
            )
        )
    emb, norm_f, head = _embeddings(ckpt)
    return MambaWeights(embedding=emb, layers=layers, norm_f=norm_f, lm_head=head)


def _mamba2_weights(ckpt: ModelTensors) -> Mamba2Weights:
    cfg = ckpt.config
    assert isinstance(cfg, Mamba2Config)
    d, di, h, k = cfg.d_model, cfg.d_inner, cfg.n_head, cfg.d_conv
    layers = []
    for b in range(cfg.n_layer):
        layers.append(
            Mamba2Layer(
                norm=ckpt.get(tensor_name(T.ATTN_NORM, b), (d,)),
                in_proj=ckpt.get_matrix(tensor_name(T.SSM_IN, b), (di + cfg.conv_dim + h, d)),
                conv_weight=ckpt.get(tensor_name(T.SSM_CONV1D, b), (cfg.conv_dim, k)),
                conv_bias=ckpt.get(tensor_name(T.SSM_CONV1D, b, ".bias"), (cfg.conv_dim,)),
                dt_bias=ckpt.get(tensor_name(T.SSM_DT, b, ".bias"), (h,)),
                A=ckpt.get(tensor_name(T.SSM_A, b, ""), (h,)),
                D=ckpt.get(tensor_name(T.SSM_D, b, ""), (h,)),
                ssm_norm=ckpt.get(tensor_name(T.SSM_NORM, b), (di,)),
                out_proj=ckpt.get_matrix(tensor_name(T.SSM_OUT, b), (d, di)),
            )
        )
    emb, norm_f, head = _embeddings(ckpt)
    return Mamba2Weights(embedding=emb, layers=layers, norm_f=norm_f, lm_head=head)
