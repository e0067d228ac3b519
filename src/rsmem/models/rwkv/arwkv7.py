"""ARWKV-7 (llama.cpp's ``arwkv7``: RWKV-7 time mixing distilled into a transformer's body, e.g.
``RWKV-Red-Team/ARWKV-7B-Preview``) on rsmem's recurrent memory, computed as llama.cpp's graph.

It differs from :mod:`rsmem.models.rwkv.rwkv7` in: RMS norms (weights only) where RWKV-7 has layer norms,
and no
norm of the embedding; a SwiGLU feed-forward (``down(silu(gate x) * up x)``) instead of the channel mix, so
one token-shift row per layer (``token_shift_count`` 1: ``r`` is ``n_embd`` floats, the last token after
the attention norm); the gate ``g`` and the per-head norm of the WKV output are optional (absent: five
lerps, no gate, no norm). The time mix itself is RWKV-7's (:meth:`Rwkv7Model.time_mix`). Decode runs
eagerly (no compiled step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rsmem.models.rwkv.base import RmsBodyMixin, RmsBodyWeights
from rsmem.models.rwkv.rwkv7 import Rwkv7Config, Rwkv7Model
from rsmem.models.step.compiled import CompileSetting


@dataclass(frozen=True, slots=True)
class Arwkv7Config(Rwkv7Config):
    """``Rwkv7Config`` read from ``arwkv7.*`` keys: ``eps`` is the RMS norms', ``d_ff`` the SwiGLU's width,
    ``n_lora_gate`` 0 when the model has no gate."""


@dataclass(slots=True)
class Arwkv7Layer:
    """One block's weights in llama.cpp's form (matrices ``[out, in]``; see ``Rwkv7Layer`` for the time
    mix's); ``g1``/``g2`` and ``ln_x``/``ln_x_b`` may be absent."""

    attn_norm: torch.Tensor
    lerp: torch.Tensor  # [6 or 5, n_embd]: r, w, k, v, a (, g)
    w0: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    a0: torch.Tensor
    a1: torch.Tensor
    a2: torch.Tensor
    k_k: torch.Tensor
    k_a: torch.Tensor
    r_k: torch.Tensor
    receptance: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_gate: torch.Tensor  # [d_ff, n_embd]
    ffn_up: torch.Tensor  # [d_ff, n_embd]
    ffn_down: torch.Tensor  # [n_embd, d_ff]
    v0: torch.Tensor | None = None  # None in the first layer (unused there)
    v1: torch.Tensor | None = None
    v2: torch.Tensor | None = None
    g1: torch.Tensor | None = None
    g2: torch.Tensor | None = None
    ln_x: torch.Tensor | None = None
    ln_x_b: torch.Tensor | None = None


Arwkv7Weights = RmsBodyWeights  # embedding, layers (Arwkv7Layer), output norm, head


class Arwkv7Model(RmsBodyMixin, Rwkv7Model):
    """An ARWKV-7 language model implementing :class:`~rsmem.models.protocol.RecurrentModel` (float32)."""

    arch = "arwkv7"
    matrices = ("receptance", "key", "value", "output", "ffn_gate", "ffn_up", "ffn_down")
    layer_cls = Arwkv7Layer
    layers: list[Arwkv7Layer]  # type: ignore[assignment]

    def __init__(
        self,
        config: Arwkv7Config,
        weights: Arwkv7Weights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ) -> None:
        super().__init__(config, weights, dtype=dtype, compile=compile)
        self.n_embd_r = config.d_model  # one token-shift row a layer

    def body_mix(
        self, ly: Arwkv7Layer, h: torch.Tensor, prev: torch.Tensor, wkv: torch.Tensor, carry: Any
    ) -> tuple[torch.Tensor, Any]:
        return self.time_mix(ly, h, prev, wkv, carry)  # carry: the first layer's values
