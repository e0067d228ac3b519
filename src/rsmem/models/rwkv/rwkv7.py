"""RWKV-7 "Goose" (``x070``) on rsmem's recurrent memory, computed as llama.cpp's ``rwkv7`` graph.

Per layer: ``x += time_mix(layer_norm(x))``, then ``x += channel_mix(layer_norm(x))``. Both mixes read
the previous token's normed input (the "token shift"). States per sequence and layer, as llama.cpp lays
them out: ``r`` = the two token-shift vectors ``[2, n_embd]`` (after the time-mix norm, then after the
channel-mix norm), ``s`` = the WKV state ``[H, V, K]`` (``n_embd * head_size`` floats).

The time mix: six lerps of the input with its shift (``r, w, k, v, a, g``), the receptance/key/value
projections, low-rank decay ``w``, in-context learning rate ``a``, value-residual mix (layers after the
first blend their values with the first layer's) and gate ``g``; the WKV recurrence
(:mod:`rsmem.models.ops.wkv`), a per-head group norm (eps 64e-5), the ``r_k`` bonus, gate and output.
The channel mix: one lerp, ``relu(key x)^2``, value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.ops.wkv import wkv7_intra, wkv7_prefill_, wkv7_step_
from rsmem.models.protocol import StateAccess
from rsmem.models.rwkv.base import (
    GROUP_NORM_EPS,
    HeldMatrices,
    RwkvModelBase,
    batch_args,
    state_args,
    token_shift,
)
from rsmem.models.step.compiled import CompiledStep
from rsmem.models.step.native import NativeStep
from rsmem.models.step.operands import RWKV7
from rsmem.models.step.wkv_fused import N_PER_LAYER, rwkv7_token_one_
from rsmem.models.step.wkv_many import MANY_OPTIONS, rwkv7_token_many_

if TYPE_CHECKING:
    from rsmem.models.rwkv.arwkv7 import Arwkv7Layer

__all__ = ["GROUP_NORM_EPS", "HeldMatrices", "Rwkv7Config", "Rwkv7Layer", "Rwkv7Model", "token_shift"]

DECAY_SCALE = 0.606531  # exp(-0.5): w = exp(-DECAY_SCALE * sigmoid(w0 + lora(x)))


@dataclass(frozen=True, slots=True)
class Rwkv7Config:
    """Hyperparameters as llama.cpp's GGUF keys hold them; ``d_ff`` 0 means ``4 * d_model``."""

    d_model: int
    n_layer: int
    n_vocab: int
    head_size: int = 64
    d_ff: int = 0
    n_lora_decay: int = 64
    n_lora_iclr: int = 64
    n_lora_value_res_mix: int = 32
    n_lora_gate: int = 128
    eps: float = 1e-5  # the layer norms'
    # WKV chunk length for prefill; 32: the least work for a prompt (16 is as good, 64 does more)
    chunk_size: int = 32

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.head_size < 1 or self.d_model % self.head_size:
            raise ValueError(f"d_model must split into heads of head_size: {self}")

    @property
    def n_head(self) -> int:
        return self.d_model // self.head_size


@dataclass(slots=True)
class Rwkv7Layer:
    """One block's weights in llama.cpp's form; matrices ``[out, in]`` (the model holds those of
    ``Rwkv7Model.matrices`` as ``[in, out]``, see :class:`HeldMatrices`), vectors ``[n_embd]``."""

    attn_norm: torch.Tensor
    attn_norm_b: torch.Tensor
    ffn_norm: torch.Tensor  # llama.cpp's attn_norm_2
    ffn_norm_b: torch.Tensor
    lerp: torch.Tensor  # [6, n_embd]: r, w, k, v, a, g (time_mix_lerp_fused)
    w0: torch.Tensor
    w1: torch.Tensor  # [n_lora_decay, n_embd]
    w2: torch.Tensor  # [n_embd, n_lora_decay]
    a0: torch.Tensor
    a1: torch.Tensor
    a2: torch.Tensor
    g1: torch.Tensor
    g2: torch.Tensor
    k_k: torch.Tensor
    k_a: torch.Tensor
    r_k: torch.Tensor  # [n_embd]: [H, N] flattened
    receptance: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    ln_x: torch.Tensor
    ln_x_b: torch.Tensor
    ffn_lerp_k: torch.Tensor
    ffn_key: torch.Tensor  # [d_ff, n_embd]
    ffn_value: torch.Tensor  # [n_embd, d_ff]
    v0: torch.Tensor | None = None  # the value-residual mix; None in the first layer (unused there)
    v1: torch.Tensor | None = None
    v2: torch.Tensor | None = None


@dataclass(slots=True)
class Rwkv7Weights:
    embedding: torch.Tensor  # [n_vocab, n_embd]
    emb_norm: torch.Tensor  # token_embd_norm (the checkpoints' blocks.0.ln0)
    emb_norm_b: torch.Tensor
    layers: list[Rwkv7Layer]
    norm_f: torch.Tensor
    norm_f_b: torch.Tensor
    lm_head: torch.Tensor  # [n_vocab, n_embd]


class Rwkv7Model(RwkvModelBase):
    """An RWKV-7 language model implementing :class:`~rsmem.models.protocol.RecurrentModel` (float32)."""

    arch = "rwkv7"
    matrices: ClassVar[tuple[str, ...]] = RWKV7.matrices
    layer_cls: ClassVar[type[Any]] = Rwkv7Layer
    config: Rwkv7Config
    layers: list[Rwkv7Layer]

    def make_compiled_steps(self) -> None:
        # args: x, emb_norm, emb_norm_b, norm_f, norm_f_b, lm_head, eps, n_head, then per layer
        # N_PER_LAYER tensors ending with the shift rows and the WKV state (written)
        self._token_one = CompiledStep(
            rwkv7_token_one_, mutated=state_args(8, N_PER_LAYER), options=self.one_options()
        )
        self._token_many = CompiledStep(
            rwkv7_token_many_,
            batch_args=batch_args(8, N_PER_LAYER, self.n_layer),
            mutated=state_args(8, N_PER_LAYER),
            options=MANY_OPTIONS,
        )
        self.wkv_intra = CompiledStep(wkv7_intra, batch_args=tuple(range(6)))

    def native_step(self) -> NativeStep | None:
        """``rsmem_native::rwkv7_step`` (``kernels/csrc/rwkv7_step.cpp``), checked against
        :func:`~rsmem.models.step.wkv_fused.rwkv7_token_one_` over the first two layers (the second mixes in
        the first's values)."""
        emb_norm, emb_norm_b, norm_f_b = self.emb_norm, self.emb_norm_b, self.norm_f_b
        n_head = self.config.n_head

        def twin(x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, *flat: Any) -> torch.Tensor:
            return rwkv7_token_one_(x, emb_norm, emb_norm_b, norm_f, norm_f_b, head, eps, n_head, *flat)

        consts = (self.config.eps, n_head, emb_norm, emb_norm_b, norm_f_b)
        return NativeStep("rwkv7_step", twin, RWKV7, consts, span=2, sliced=True)

    def step_fields(self, ly: Rwkv7Layer, operand: Callable[[torch.Tensor], Any]) -> list[Any]:
        fields = []
        for name in RWKV7.weights:
            t = getattr(ly, name)
            if t is None:  # the first layer's unused value-residual mix
                t = {"v0": ly.a0, "v1": ly.a1, "v2": ly.a2}[name]
            fields.append(operand(t) if name in self.matrices else t)
        return fields

    def step_consts(self) -> tuple[float | int, ...]:
        return self.config.eps, self.config.n_head

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; reads and writes each layer's states."""
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        n_seqs = tokens.shape[0]
        c = cfg.d_model
        if tokens.shape[1] == 1 and self.decode_path(n_seqs) != "layers":
            if n_seqs == 1:
                logits = self.decode_one(tokens[0], states)
            else:
                logits = self.decode_many(tokens[:, 0], states)
            if logits is not None:
                return self.output_logits(logits, ubatch)
        x = F.layer_norm(self.embedding[tokens], (c,), self.emb_norm, self.emb_norm_b, cfg.eps)
        v_first: torch.Tensor | None = None
        for il, ly in enumerate(self.layers):
            r_rows, s_rows = states.read_states(il)
            shift = r_rows.view(n_seqs, 2, c).float()
            wkv = s_rows.view(n_seqs, cfg.n_head, cfg.head_size, cfg.head_size)
            wkv = wkv if wkv.dtype == torch.float32 else wkv.float()
            h = F.layer_norm(x, (c,), ly.attn_norm, ly.attn_norm_b, cfg.eps)
            out, v_first = self.time_mix(ly, h, token_shift(h, shift[:, 0]), wkv, v_first)
            x = x + out
            f = F.layer_norm(x, (c,), ly.ffn_norm, ly.ffn_norm_b, cfg.eps)
            x = x + self.channel_mix(ly, f, token_shift(f, shift[:, 1]))
            states.write_states(il, torch.stack([h[:, -1], f[:, -1]], dim=1), wkv)
        return self.head(x, ubatch)

    def time_mix(
        self,
        ly: Rwkv7Layer | Arwkv7Layer,
        x: torch.Tensor,
        prev: torch.Tensor,
        wkv: torch.Tensor,
        v_first: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``prev`` ``[Bs, L, C]``; updates ``wkv`` in place; returns the output and the first layer's
        values (``v_first``: None in the first layer, which sets it)."""
        cfg = self.config
        n_seqs, n_tokens, c = x.shape
        heads = (n_seqs, n_tokens, cfg.n_head, cfg.head_size)
        n_mix = ly.lerp.shape[0]  # 6; ARWKV-7 without a gate: 5
        xr, xw, xk, xv, xa, *xg = (x + (prev - x) * ly.lerp.view(n_mix, 1, 1, c)).unbind(0)
        r = self.held.linear(xr, ly.receptance)
        log_w = -DECAY_SCALE * torch.sigmoid(ly.w0 + F.linear(torch.tanh(F.linear(xw, ly.w1)), ly.w2))
        k = self.held.linear(xk, ly.key)
        v = self.held.linear(xv, ly.value)
        if v_first is None:
            v_first = v
        else:
            assert ly.v0 is not None and ly.v1 is not None and ly.v2 is not None
            v = v + (v_first - v) * torch.sigmoid(ly.v0 + F.linear(F.linear(xv, ly.v1), ly.v2))
        a = torch.sigmoid(ly.a0 + F.linear(F.linear(xa, ly.a1), ly.a2))
        kk = F.normalize((k * ly.k_k).view(heads), dim=-1, p=2.0, eps=1e-12)
        k = k * (1 + (a - 1) * ly.k_a)
        rh, kh, vh, ah = (t.view(heads) for t in (r, k, v, a))
        if n_tokens == 1:
            y = wkv7_step_(wkv, rh[:, 0], log_w.view(heads)[:, 0].exp(), kh[:, 0], vh[:, 0], -kk[:, 0],
                           (kk * ah)[:, 0]).unsqueeze(1)  # fmt: skip
        else:
            y = wkv7_prefill_(
                wkv, rh, log_w.view(heads), kh, vh, -kk, kk * ah, cfg.chunk_size, self.prefill_intra()
            )
        if ly.ln_x is not None:  # absent in some ARWKV-7 models: no norm
            y = F.group_norm(y.reshape(-1, c), cfg.n_head, ly.ln_x, ly.ln_x_b, GROUP_NORM_EPS).view(heads)
        y = y + (rh * kh * ly.r_k.view(cfg.n_head, cfg.head_size)).sum(-1, keepdim=True) * vh
        y = y.reshape(n_seqs, n_tokens, c)
        if ly.g1 is not None and ly.g2 is not None:  # the gate (optional in ARWKV-7)
            y = y * F.linear(torch.sigmoid(F.linear(xg[0], ly.g1)), ly.g2)
        return self.held.linear(y, ly.output), v_first

    def channel_mix(self, ly: Rwkv7Layer, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        k = torch.relu(self.held.linear(x + (prev - x) * ly.ffn_lerp_k, ly.ffn_key)).square()
        return self.held.linear(k, ly.ffn_value)
