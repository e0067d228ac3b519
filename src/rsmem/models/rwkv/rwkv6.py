"""RWKV-6 "Finch" (``x060``) on rsmem's recurrent memory, computed as llama.cpp's ``rwkv6`` graph.

Per layer: ``x += time_mix(layer_norm(x))``, then ``x += channel_mix(layer_norm(x))``; with
``rescale_every_n_layers`` N > 0 the residual is halved after every N-th layer (llama.cpp's converter divides
the output and channel-mix value matrices to match). States per sequence and layer, as llama.cpp lays them
out: ``r`` = the two token-shift vectors ``[2, n_embd]`` (after the time-mix norm, then after the channel-mix
norm), ``s`` = the WKV state ``[H, K, V]``.

The time mix: a data-dependent lerp (``lerp_x``, then a low-rank ``tanh`` mixer giving five offsets for
``w, k, v, r, g``), receptance/key/value/gate projections, the decay ``w = exp(-exp(decay + lora(x_w)))``,
the WKV recurrence with the bonus ``u`` (:mod:`rsmem.models.ops.wkv6`), a per-head group norm (eps 64e-5),
``silu`` gate and output. The channel mix: ``sigmoid(receptance x_r) * value(relu(key x_k)^2)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.ops.wkv6 import wkv6_intra, wkv6_prefill_, wkv6_step_
from rsmem.models.protocol import StateAccess
from rsmem.models.rwkv.base import GROUP_NORM_EPS, RwkvModelBase, batch_args, state_args, token_shift
from rsmem.models.step.compiled import CompiledStep
from rsmem.models.step.native import NativeStep
from rsmem.models.step.operands import RWKV6
from rsmem.models.step.wkv_fused import N6_PER_LAYER, rwkv6_token_one_
from rsmem.models.step.wkv_many import MANY_OPTIONS, rwkv6_token_many_


@dataclass(frozen=True, slots=True)
class Rwkv6Config:
    """Hyperparameters as llama.cpp's GGUF keys hold them; ``d_ff`` 0: ``int(3.5 * d_model) // 32 * 32``."""

    d_model: int
    n_layer: int
    n_vocab: int
    head_size: int = 64
    d_ff: int = 0
    time_mix_extra_dim: int = 32
    time_decay_extra_dim: int = 64
    rescale_every_n_layers: int = 0
    eps: float = 1e-5  # the layer norms'
    # WKV chunk length for prefill (pairwise decays: see ops.wkv6); 8: less work for a prompt than 16
    chunk_size: int = 8

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", int(self.d_model * 3.5) // 32 * 32)
        if self.head_size < 1 or self.d_model % self.head_size:
            raise ValueError(f"d_model must split into heads of head_size: {self}")

    @property
    def n_head(self) -> int:
        return self.d_model // self.head_size


@dataclass(slots=True)
class Rwkv6Layer:
    """One block's weights in llama.cpp's form; matrices ``[out, in]`` (the model holds those of
    ``Rwkv6Model.matrices`` as ``[in, out]``), vectors ``[n_embd]``."""

    attn_norm: torch.Tensor
    attn_norm_b: torch.Tensor
    ffn_norm: torch.Tensor  # llama.cpp's attn_norm_2
    ffn_norm_b: torch.Tensor
    lerp_x: torch.Tensor
    lerp: torch.Tensor  # [5, n_embd]: w, k, v, r, g (time_mix_lerp_fused)
    w1: torch.Tensor  # [5 * extra, n_embd]
    w2: torch.Tensor  # [5, n_embd, extra]
    decay: torch.Tensor
    decay_w1: torch.Tensor  # [decay_extra, n_embd]
    decay_w2: torch.Tensor  # [n_embd, decay_extra]
    first: torch.Tensor  # u: [H, N]
    receptance: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    gate: torch.Tensor
    output: torch.Tensor
    ln_x: torch.Tensor
    ln_x_b: torch.Tensor
    ffn_lerp_k: torch.Tensor
    ffn_lerp_r: torch.Tensor
    ffn_key: torch.Tensor  # [d_ff, n_embd]
    ffn_value: torch.Tensor  # [n_embd, d_ff]
    ffn_receptance: torch.Tensor  # [n_embd, n_embd]


@dataclass(slots=True)
class Rwkv6Weights:
    embedding: torch.Tensor
    emb_norm: torch.Tensor
    emb_norm_b: torch.Tensor
    layers: list[Rwkv6Layer]
    norm_f: torch.Tensor
    norm_f_b: torch.Tensor
    lm_head: torch.Tensor


class Rwkv6Model(RwkvModelBase):
    """An RWKV-6 language model implementing :class:`~rsmem.models.protocol.RecurrentModel` (float32)."""

    arch = "rwkv6"
    matrices = RWKV6.matrices
    layer_cls = Rwkv6Layer
    config: Rwkv6Config
    layers: list[Rwkv6Layer]

    def make_compiled_steps(self) -> None:
        # args: x, emb_norm, emb_norm_b, norm_f, norm_f_b, lm_head, eps, n_head, rescale, then per
        # layer N6_PER_LAYER tensors ending with the shift rows and the WKV state (written)
        self._token_one = CompiledStep(
            rwkv6_token_one_, mutated=state_args(9, N6_PER_LAYER), options=self.one_options()
        )
        self._token_many = CompiledStep(
            rwkv6_token_many_,
            batch_args=batch_args(9, N6_PER_LAYER, self.n_layer),
            mutated=state_args(9, N6_PER_LAYER),
            options=MANY_OPTIONS,
        )
        self.wkv_intra = CompiledStep(wkv6_intra, batch_args=tuple(range(5)))

    def native_step(self) -> NativeStep | None:
        """``rsmem_native::rwkv6_step`` (``kernels/csrc/rwkv6_step.cpp``), checked against
        :func:`~rsmem.models.step.wkv_fused.rwkv6_token_one_`."""
        emb_norm, emb_norm_b, norm_f_b = self.emb_norm, self.emb_norm_b, self.norm_f_b
        cfg = self.config

        def twin(x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, *flat: Any) -> torch.Tensor:
            return rwkv6_token_one_(
                x,
                emb_norm,
                emb_norm_b,
                norm_f,
                norm_f_b,
                head,
                eps,
                cfg.n_head,
                cfg.rescale_every_n_layers,
                *flat,
            )

        consts = (cfg.eps, cfg.n_head, cfg.rescale_every_n_layers, emb_norm, emb_norm_b, norm_f_b)
        return NativeStep("rwkv6_step", twin, RWKV6, consts, sliced=True)

    def step_fields(self, ly: Rwkv6Layer, operand: Callable[[torch.Tensor], Any]) -> list[Any]:
        return list(RWKV6.of(ly, operand))

    def step_consts(self) -> tuple[float | int, ...]:
        cfg = self.config
        return cfg.eps, cfg.n_head, cfg.rescale_every_n_layers

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
        for il, ly in enumerate(self.layers):
            r_rows, s_rows = states.read_states(il)
            shift = r_rows.view(n_seqs, 2, c).float()
            wkv = s_rows.view(n_seqs, cfg.n_head, cfg.head_size, cfg.head_size)
            wkv = wkv if wkv.dtype == torch.float32 else wkv.float()
            h = F.layer_norm(x, (c,), ly.attn_norm, ly.attn_norm_b, cfg.eps)
            x = x + self.time_mix(ly, h, token_shift(h, shift[:, 0]), wkv)
            f = F.layer_norm(x, (c,), ly.ffn_norm, ly.ffn_norm_b, cfg.eps)
            x = x + self.channel_mix(ly, f, token_shift(f, shift[:, 1]))
            if cfg.rescale_every_n_layers and (il + 1) % cfg.rescale_every_n_layers == 0:
                x = x * 0.5
            states.write_states(il, torch.stack([h[:, -1], f[:, -1]], dim=1), wkv)
        return self.head(x, ubatch)

    def time_mix(
        self, ly: Rwkv6Layer, x: torch.Tensor, prev: torch.Tensor, wkv: torch.Tensor
    ) -> torch.Tensor:
        """``x``, ``prev`` ``[Bs, L, C]``; updates ``wkv`` in place; returns the mix's output."""
        cfg = self.config
        n_seqs, n_tokens, c = x.shape
        heads = (n_seqs, n_tokens, cfg.n_head, cfg.head_size)
        sx = prev - x
        mixer = torch.tanh(F.linear(x + sx * ly.lerp_x, ly.w1)).view(n_seqs, n_tokens, 5, -1)
        offsets = torch.einsum("blge,gce->blgc", mixer, ly.w2)  # [Bs, L, 5, C]
        xw, xk, xv, xr, xg = (x.unsqueeze(2) + sx.unsqueeze(2) * (offsets + ly.lerp)).unbind(2)
        r = self.held.linear(xr, ly.receptance).view(heads)
        k = self.held.linear(xk, ly.key).view(heads)
        v = self.held.linear(xv, ly.value).view(heads)
        g = F.silu(self.held.linear(xg, ly.gate))
        log_w = -torch.exp(ly.decay + F.linear(torch.tanh(F.linear(xw, ly.decay_w1)), ly.decay_w2)).view(
            heads
        )
        if n_tokens == 1:
            y = wkv6_step_(wkv, r[:, 0], log_w[:, 0].exp(), k[:, 0], v[:, 0], ly.first).unsqueeze(1)
        else:
            y = wkv6_prefill_(wkv, r, log_w, k, v, ly.first, cfg.chunk_size, self.prefill_intra())
        y = F.group_norm(y.reshape(-1, c), cfg.n_head, ly.ln_x, ly.ln_x_b, GROUP_NORM_EPS)
        return self.held.linear(y.view(n_seqs, n_tokens, c) * g, ly.output)

    def channel_mix(self, ly: Rwkv6Layer, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        sx = prev - x
        r = torch.sigmoid(self.held.linear(x + sx * ly.ffn_lerp_r, ly.ffn_receptance))
        k = torch.relu(self.held.linear(x + sx * ly.ffn_lerp_k, ly.ffn_key)).square()
        return r * self.held.linear(k, ly.ffn_value)
