"""The common form every loader produces: llama.cpp's tensor names and layouts, plus the hyperparameters.

GGUF files already hold this form; HF folders are mapped into it (``hf.py``), so one builder makes the
models and one writer makes GGUF files (``convert.py``). Names come from ``gguf.TENSOR_NAMES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.tokenizer import TokenizerData
from rsmem.models.compiled import CompileSetting
from rsmem.models.lfm2 import Lfm2Model
from rsmem.models.mamba import MambaConfig, MambaLayer, MambaModel, MambaWeights
from rsmem.models.mamba2 import Mamba2Config, Mamba2Layer, Mamba2Model, Mamba2Weights
from rsmem.models.nemotron_h import NemotronHModel
from rsmem.models.ops.quantized import Matrix, QuantMatrix
from rsmem.models.qwen35 import Qwen35Model

SUPPORTED_ARCHS = (
    "mamba",
    "mamba2",
    "lfm2",
    "nemotron_h",
    "qwen35",
    "rwkv7",
    "rwkv6",
    "arwkv7",
    "rwkv6qwen2",
)
T = gguf.MODEL_TENSOR


def tensor_name(kind: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight") -> str:
    """llama.cpp's name of a tensor, e.g. ``blk.3.ssm_in.weight``; ``ssm_a`` and ``ssm_d`` have no suffix."""
    base = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=bid) if bid is not None else base) + suffix


@dataclass(slots=True)
class Checkpoint:
    """A model in llama.cpp's form: ``tensors`` maps GGUF names to float tensors in numpy (``[out, in]``)
    order, with llama.cpp's transforms applied (``ssm_a = -exp(A_log)``, squeezed conv kernels, ...)."""

    arch: str
    config: MambaConfig | Mamba2Config
    tensors: dict[str, torch.Tensor]
    tokenizer: TokenizerData | None = None
    source: str = ""
    meta: dict[str, object] = field(default_factory=dict)
    # matrices kept in their quantized blocks (GGUF files of architectures that multiply them), by name
    quantized: dict[str, QuantMatrix] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.quantized

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor ``name`` as float32 (a matrix kept quantized is dequantized; reshaped to ``shape`` if
        given); ModelFormatError if absent or mis-sized."""
        t = self.get_matrix(name, shape)
        return t.dequantize() if isinstance(t, QuantMatrix) else t

    def get_matrix(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | QuantMatrix:
        """:meth:`get`, keeping a quantized matrix in its blocks (for models that multiply them)."""
        t: torch.Tensor | QuantMatrix | None = self.quantized.get(name, self.tensors.get(name))
        if t is None:
            raise ModelFormatError(f"{self.source}: missing tensor {name!r} ({self.arch})")
        if shape is not None:
            if t.numel() != _numel(shape) or (isinstance(t, QuantMatrix) and t.shape != shape):
                raise ModelFormatError(
                    f"{self.source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
                )
            t = t.reshape(shape)
        return t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_model(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
) -> MambaModel | Mamba2Model | Lfm2Model | NemotronHModel | Qwen35Model:
    """Make the model of ``ckpt.arch`` from its tensors (``compile``: see ``set_compile`` of the models)."""
    if ckpt.arch == "mamba":
        return MambaModel(ckpt.config, _mamba_weights(ckpt), dtype=dtype, compile=compile)  # type: ignore[arg-type]
    if ckpt.arch == "mamba2":
        return Mamba2Model(ckpt.config, _mamba2_weights(ckpt), dtype=dtype, compile=compile)  # type: ignore[arg-type]
    from rsmem.loaders.hybrid import HYBRID_ARCHS, build_hybrid  # it imports this module's Checkpoint

    if ckpt.arch in HYBRID_ARCHS:
        return build_hybrid(ckpt, dtype, compile)
    from rsmem.loaders.rwkv import RWKV_ARCHS, build_rwkv  # it imports this module's Checkpoint

    if ckpt.arch in RWKV_ARCHS:
        return build_rwkv(ckpt, dtype, compile)  # type: ignore[return-value]
    raise ModelFormatError(f"{ckpt.source}: unsupported architecture {ckpt.arch!r}")


def _embeddings(ckpt: Checkpoint) -> tuple[Matrix, torch.Tensor, Matrix]:
    cfg = ckpt.config
    emb = ckpt.get_matrix(tensor_name(T.TOKEN_EMBD), (cfg.n_vocab, cfg.d_model))
    norm_f = ckpt.get(tensor_name(T.OUTPUT_NORM), (cfg.d_model,))
    head_name = tensor_name(T.OUTPUT)
    head = ckpt.get_matrix(head_name, (cfg.n_vocab, cfg.d_model)) if head_name in ckpt else emb
    return emb, norm_f, head


def _mamba_weights(ckpt: Checkpoint) -> MambaWeights:
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


def _mamba2_weights(ckpt: Checkpoint) -> Mamba2Weights:
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
