"""QRWKV-6 (llama.cpp's ``rwkv6qwen2``: RWKV-6 time mixing in a Qwen2 body, e.g.
``recursal/QRWKV6-32B-Instruct-Preview``) on rsmem's recurrent memory, computed as llama.cpp's graph.

Per layer: ``x += time_mix(rms_norm(x))``, then ``x += down(silu(gate f) * up f)`` with ``f = rms_norm(x)``;
one token-shift row (``token_shift_count`` 1: ``r`` is ``n_embd`` floats), ``s`` the attention state
``[H, K, V]``. The time mix is RWKV-6's data-dependent lerp and decay ``w = exp(-exp(decay + lora))``, then:
optional receptance/key/value biases; keys and values of ``n_head_kv`` heads repeated to all heads (as
grouped-query attention); ``k *= 1 - w``; the gated linear attention of :mod:`rsmem.models.ops.gla` (scale
``head_size ** -0.5``, no bonus, no group norm); a ``sigmoid`` gate. llama.cpp takes this form when a layer
has no ``time_mix_first``; files with one are refused (llama.cpp loads no output norm for them). Decode
runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from rsmem.models.ops.gla import gla_chunked_, gla_step_
from rsmem.models.rwkv.base import RmsBodyMixin, RmsBodyWeights, RwkvModelBase
from rsmem.models.rwkv.rwkv6 import Rwkv6Config
from rsmem.models.step.compiled import CompileSetting


@dataclass(frozen=True, slots=True)
class Rwkv6Qwen2Config(Rwkv6Config):
    """``Rwkv6Config`` read from ``rwkv6qwen2.*`` keys (``eps`` the RMS norms'), with the key/value head
    count (0: as many as the heads)."""

    n_head_kv: int = 0

    @property
    def kv_heads(self) -> int:
        return self.n_head_kv or self.n_head


@dataclass(slots=True)
class Rwkv6Qwen2Layer:
    """One block's weights in llama.cpp's form: matrices ``[out, in]``, key and value
    ``[kv_heads * N, C]``."""

    attn_norm: torch.Tensor
    lerp_x: torch.Tensor
    lerp: torch.Tensor  # [5, n_embd]: w, k, v, r, g
    w1: torch.Tensor  # [5 * extra, n_embd]
    w2: torch.Tensor  # [5, n_embd, extra]
    decay: torch.Tensor
    decay_w1: torch.Tensor
    decay_w2: torch.Tensor
    receptance: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    gate: torch.Tensor
    output: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_gate: torch.Tensor
    ffn_up: torch.Tensor
    ffn_down: torch.Tensor
    receptance_b: torch.Tensor | None = None
    key_b: torch.Tensor | None = None
    value_b: torch.Tensor | None = None


class Rwkv6Qwen2Model(RmsBodyMixin, RwkvModelBase):
    """A QRWKV-6 language model implementing :class:`~rsmem.models.protocol.RecurrentModel` (float32)."""

    arch = "rwkv6qwen2"
    matrices: ClassVar[tuple[str, ...]] = (
        "receptance", "key", "value", "gate", "output", "ffn_gate", "ffn_up", "ffn_down",
    )  # fmt: skip
    layer_cls: ClassVar[type[Any]] = Rwkv6Qwen2Layer
    config: Rwkv6Qwen2Config
    layers: list[Rwkv6Qwen2Layer]

    def __init__(
        self,
        config: Rwkv6Qwen2Config,
        weights: RmsBodyWeights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ) -> None:
        """``weights``: embedding, layers (:class:`Rwkv6Qwen2Layer`), output norm, head."""
        super().__init__(config, weights, dtype=dtype, compile=compile)
        self.n_embd_r = config.d_model  # one token-shift row a layer

    def body_mix(
        self, ly: Rwkv6Qwen2Layer, h: torch.Tensor, prev: torch.Tensor, wkv: torch.Tensor, carry: Any
    ) -> tuple[torch.Tensor, Any]:
        return self.time_mix(ly, h, prev, wkv), None

    def time_mix(
        self, ly: Rwkv6Qwen2Layer, x: torch.Tensor, prev: torch.Tensor, wkv: torch.Tensor
    ) -> torch.Tensor:
        """``x``, ``prev`` ``[Bs, L, C]``; updates ``wkv`` in place; returns the mix's output."""
        cfg = self.config
        n_seqs, n_tokens, c = x.shape
        heads = (n_seqs, n_tokens, cfg.n_head, cfg.head_size)
        linear = self.held.linear
        sx = prev - x
        mixer = torch.tanh(F.linear(x + sx * ly.lerp_x, ly.w1)).view(n_seqs, n_tokens, 5, -1)
        offsets = torch.einsum("blge,gce->blgc", mixer, ly.w2)  # [Bs, L, 5, C]
        xw, xk, xv, xr, xg = (x.unsqueeze(2) + sx.unsqueeze(2) * (offsets + ly.lerp)).unbind(2)
        r, k, v = linear(xr, ly.receptance), linear(xk, ly.key), linear(xv, ly.value)
        r = r if ly.receptance_b is None else r + ly.receptance_b
        k = k if ly.key_b is None else k + ly.key_b
        v = v if ly.value_b is None else v + ly.value_b
        rep = cfg.n_head // cfg.kv_heads  # each key/value head serves rep heads, in order
        kv_heads = (n_seqs, n_tokens, cfg.kv_heads, cfg.head_size)
        k = k.view(kv_heads).repeat_interleave(rep, dim=2)
        v = v.view(kv_heads).repeat_interleave(rep, dim=2)
        g = torch.sigmoid(linear(xg, ly.gate))
        log_w = -torch.exp(ly.decay + F.linear(torch.tanh(F.linear(xw, ly.decay_w1)), ly.decay_w2)).view(
            heads
        )
        w = log_w.exp()
        k = k * (1 - w)
        rh, scale = r.view(heads), cfg.head_size**-0.5
        if n_tokens == 1:
            y = gla_step_(wkv, rh[:, 0], w[:, 0], k[:, 0], v[:, 0], scale).unsqueeze(1)
        else:
            y = gla_chunked_(wkv, rh, log_w, k, v, scale, cfg.chunk_size)
        return linear(y.reshape(n_seqs, n_tokens, c) * g, ly.output)
