"""What the four RWKV GGUF readers (``rwkv7``, ``rwkv6``, ``arwkv7``, ``rwkv6qwen2``) share: reading
``{arch}.*`` hyperparameters with errors that name the key, and a layer's tensors by llama.cpp's names.

``ArchKeys(arch, key, optional)`` wraps the two lookups the GGUF reader hands over (``key`` raises for a
missing key, ``optional`` gives None); ``LayerTensors(ckpt, b)`` reads layer ``b``'s tensors with their
shapes checked; :func:`rwkv6_time_mix` is the time-mix part RWKV-6 and QRWKV-6 lay out alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.hparams import Hparams, consistent
from rsmem.loaders.tensors import tensor_name

if TYPE_CHECKING:
    from rsmem.loaders.tensors import ModelTensors

__all__ = ["ArchKeys", "LayerTensors", "consistent", "rwkv6_time_mix"]

T = gguf.MODEL_TENSOR


class ArchKeys(Hparams):
    """The ``{arch}.*`` metadata of one file, read as numbers in their ranges (``hparams.py``)."""

    def integer(self, k: str) -> int:
        return self.count(k)

    def float_or(self, k: str, default: float) -> float:
        return self.epsilon_or(k, default)

    def integer_or(self, k: str, default: int) -> int:
        """A count that may be 0 (``rescale_every_n_layers``, ARWKV-7's gate rank: 0 for none)."""
        return self.count_or(k, default, 0)

    def token_shift(self, count: int) -> None:
        """ModelFormatError unless ``token_shift_count`` is absent or ``count``."""
        shift = self.count_or("token_shift_count", count, 0)
        if shift != count:
            raise ModelFormatError(f"{self.arch} needs token_shift_count {count}, got {shift!r}")

    def body(self) -> dict[str, int]:
        """The keys every RWKV config has: width, depth, head size and feed-forward width."""
        d_model, head_size = self.integer("embedding_length"), self.integer("wkv.head_size")
        self.divides("wkv.head_size", head_size, "embedding_length", d_model)
        return {
            "d_model": d_model,
            "n_layer": self.integer("block_count"),
            "head_size": head_size,
            "d_ff": self.integer("feed_forward_length"),
        }

    def v7_loras(self) -> dict[str, int]:
        """RWKV-7's low-rank widths (decay, in-context learning rate, value residual mix)."""
        return {
            "n_lora_decay": self.integer("attention.decay_lora_rank"),
            "n_lora_iclr": self.integer("attention.iclr_lora_rank"),
            "n_lora_value_res_mix": self.integer("attention.value_residual_mix_lora_rank"),
        }

    def v6_extra(self) -> dict[str, int]:
        """RWKV-6's low-rank widths of the token-shift mix and of the decay."""
        return {
            "time_mix_extra_dim": self.integer("time_mix_extra_dim"),
            "time_decay_extra_dim": self.integer("time_decay_extra_dim"),
        }


class LayerTensors:
    """Layer ``b``'s tensors of ``ckpt``: ``get(kind, shape)`` checks the shape (ModelFormatError naming
    the tensor), ``has`` asks whether the file holds one, ``bias`` gives an optional ``.bias``."""

    def __init__(self, ckpt: ModelTensors, b: int) -> None:
        self.ckpt = ckpt
        self.b = b

    def name(self, kind: gguf.MODEL_TENSOR, suffix: str = ".weight") -> str:
        return tensor_name(kind, self.b, suffix)

    def get(self, kind: gguf.MODEL_TENSOR, shape: tuple[int, ...], suffix: str = ".weight") -> torch.Tensor:
        return self.ckpt.get(self.name(kind, suffix), shape)

    def has(self, kind: gguf.MODEL_TENSOR, suffix: str = ".weight") -> bool:
        return self.name(kind, suffix) in self.ckpt.tensors

    def bias(self, kind: gguf.MODEL_TENSOR, n: int) -> torch.Tensor | None:
        return self.get(kind, (n,), ".bias") if self.has(kind, ".bias") else None

    def lora(
        self, k1: gguf.MODEL_TENSOR, k2: gguf.MODEL_TENSOR, d: int, rank: int
    ) -> tuple[torch.Tensor, ...]:
        """A low-rank pair: ``k1`` ``[rank, d]`` and ``k2`` ``[d, rank]``."""
        return self.get(k1, (rank, d)), self.get(k2, (d, rank))


def rwkv6_time_mix(t: LayerTensors, d: int, e: int, de: int) -> dict[str, torch.Tensor]:
    """The time-mix tensors RWKV-6 and QRWKV-6 share (their key/value widths and extras differ):
    the data-dependent token shift, the decay and its low-rank update, and receptance/gate/output."""
    return {
        "lerp_x": t.get(T.TIME_MIX_LERP_X, (d,)),
        "lerp": t.get(T.TIME_MIX_LERP_FUSED, (5, d)),
        "w1": t.get(T.TIME_MIX_W1, (5 * e, d)),
        "w2": t.get(T.TIME_MIX_W2, (5, d, e)),
        "decay": t.get(T.TIME_MIX_DECAY, (d,)),
        "decay_w1": t.get(T.TIME_MIX_DECAY_W1, (de, d)),
        "decay_w2": t.get(T.TIME_MIX_DECAY_W2, (d, de)),
        "receptance": t.get(T.TIME_MIX_RECEPTANCE, (d, d)),
        "gate": t.get(T.TIME_MIX_GATE, (d, d)),
        "output": t.get(T.TIME_MIX_OUTPUT, (d, d)),
    }
