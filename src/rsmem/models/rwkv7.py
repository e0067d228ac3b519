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

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.compiled import CompiledStep, CompileSetting, resolve_compile
from rsmem.models.ops.common import output_rows
from rsmem.models.ops.packed import PackedMatrices, held_matrix, packing_enabled
from rsmem.models.ops.wkv import wkv7_chunked_, wkv7_step_
from rsmem.models.ops.wkv_fused import (
    N_PER_LAYER,
    RWKV7_FIELDS,
    rwkv7_ffn_in_,
    rwkv7_mix_,
    rwkv7_token_one_,
    rwkv7_wkv_,
)
from rsmem.models.protocol import StateAccess

if TYPE_CHECKING:
    from tokenizers import Tokenizer

GROUP_NORM_EPS = 64e-5  # the time mix's per-head norm, fixed in llama.cpp and the rwkv package
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
    chunk_size: int = 64  # WKV chunk length for prefill

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


class HeldMatrices:
    """A model's big matrices held as rsmem's Mamba models hold theirs (:mod:`rsmem.models.ops.packed`):
    ``[in, out]`` tensors in the compute dtype, float32 ones with oneDNN twins where packing is available
    (one-row products stream the ``[out, in]`` matrix, several rows use the packed copy)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.packing = packing_enabled()
        self.packed = PackedMatrices()

    def hold(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[out, in]`` as the ``[in, out]`` tensor :meth:`linear` takes."""
        weight_t = held_matrix(weight, self.dtype, self.packing)
        if self.packing:
            self.packed.add(weight_t)
        return weight_t

    def linear(self, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        """``x @ weight_t``, float32 out."""
        return self.packed.linear(x, weight_t)


def token_shift(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The previous token's rows: ``x`` ``[Bs, L, C]`` shifted by one, ``last`` ``[Bs, C]`` first."""
    return torch.cat([last.unsqueeze(1), x[:, :-1]], dim=1)


class Rwkv7Model:
    """An RWKV-7 language model implementing :class:`~rsmem.models.protocol.RecurrentModel` (float32)."""

    arch = "rwkv7"
    matrices = ("receptance", "key", "value", "output", "ffn_key", "ffn_value")  # held in ``dtype``

    def __init__(
        self,
        config: Rwkv7Config,
        weights: Rwkv7Weights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ) -> None:
        """``dtype``: the big matrices' and the head's (float32 or bfloat16); everything else is float32.
        ``compile``: whether one-sequence decode steps run compiled (see :meth:`set_compile`)."""
        self.config = config
        self.dtype = dtype
        self.n_vocab = config.n_vocab
        self.n_layer = config.n_layer
        self.n_embd_r = 2 * config.d_model
        self.n_embd_s = config.d_model * config.head_size
        self.tokenizer: Tokenizer | None = None  # set by the loaders when the file carries one
        self.embedding = weights.embedding.to(torch.float32).contiguous()
        self.emb_norm = weights.emb_norm.to(torch.float32)
        self.emb_norm_b = weights.emb_norm_b.to(torch.float32)
        self.norm_f = weights.norm_f.to(torch.float32)
        self.norm_f_b = weights.norm_f_b.to(torch.float32)
        self.held = HeldMatrices(dtype)
        self.lm_head = self.held.hold(weights.lm_head)  # [in, out]
        self.layers = [self._held_layer(ly) for ly in weights.layers]
        matrices = [self.lm_head, *(getattr(ly, name) for ly in self.layers for name in self.matrices)]
        self._n_matrix_weights = sum(m.numel() for m in matrices)
        # the compiled step streams [out, in] rows: float32 matrices held as views of them (with packing)
        self._rows_contiguous = all(m.t().is_contiguous() for m in matrices)
        self.compile_decode = False
        self.set_compile(compile)

    def _held_layer(self, ly: Rwkv7Layer) -> Rwkv7Layer:
        """A copy of ``ly``: the matrices of :attr:`matrices` held ``[in, out]`` (:class:`HeldMatrices`),
        every other tensor float32."""
        fields = {
            name: None
            if (t := getattr(ly, name)) is None
            else self.held.hold(t)
            if name in self.matrices
            else t.to(torch.float32).contiguous()
            for name in Rwkv7Layer.__slots__
        }
        return Rwkv7Layer(**fields)  # type: ignore[arg-type]

    def is_recurrent_layer(self, il: int) -> bool:
        return True

    def set_compile(self, setting: CompileSetting) -> bool:
        """Whether a one-sequence decode step runs as one compiled function (:mod:`rsmem.models.compiled`:
        ``"auto"``, True/False, ``"1"``/``"0"``; None reads ``RSMEM_COMPILE``); only with matrices held as
        float32 ``[out, in]`` rows. Returns the decision."""
        decided = resolve_compile(setting, self._n_matrix_weights, self.embedding.device)
        self.compile_decode = decided and self._rows_contiguous
        if self.compile_decode and not hasattr(self, "_token_one"):
            # args: x, emb_norm, emb_norm_b, norm_f, norm_f_b, lm_head, eps, n_head, then per layer
            # N_PER_LAYER tensors ending with the shift rows and the WKV state (written)
            self._token_one = CompiledStep(
                rwkv7_token_one_, mutated=lambda i: i >= 8 and (i - 8) % N_PER_LAYER >= N_PER_LAYER - 2
            )
            # several sequences: the glue between the packed products (see _decode_batch)
            self._mix = CompiledStep(rwkv7_mix_, batch_args=(0, 1, 2), mutated=(2,))
            self._wkv = CompiledStep(rwkv7_wkv_, batch_args=tuple(range(9)), mutated=(8,))
            self._ffn_in = CompiledStep(rwkv7_ffn_in_, batch_args=(0, 1, 2), mutated=(2,))
        return self.compile_decode

    def warm_up(self) -> float:
        """Compile the one-sequence step now on a scratch memory; the seconds it took (0: not compiling)."""
        if not self.compile_decode:
            return 0.0
        from rsmem.batch.batch import Batch  # here: rsmem.context imports the models package
        from rsmem.context import Context

        started = time.perf_counter()
        Context(self).decode(Batch([1, 2]))
        Context(self).decode(Batch([1]))
        return time.perf_counter() - started

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; reads and writes each layer's states."""
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        n_seqs = tokens.shape[0]
        c = cfg.d_model
        if self.compile_decode and tokens.shape[1] == 1:
            if n_seqs == 1:
                logits = self._decode_one(tokens[0], states)
            else:
                logits = self._decode_batch(tokens[:, 0], ubatch, states)
            if logits is not None:
                return logits[: len(ubatch.output_rows())]
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
        x = output_rows(x, ubatch.output_rows())
        x = F.layer_norm(x, (c,), self.norm_f, self.norm_f_b, cfg.eps)
        return self.held.linear(x, self.lm_head)

    def _decode_one(self, token: torch.Tensor, states: StateAccess) -> torch.Tensor | None:
        """One token of one sequence through the compiled step (:mod:`~rsmem.models.ops.wkv_fused`); None
        (nothing read) when the state rows are not float32."""
        cfg = self.config
        rows = [states.read_states(il) for il in range(self.n_layer)]
        if any(r.dtype != torch.float32 or s.dtype != torch.float32 for r, s in rows):
            return None  # decoded eagerly: reading the rows again is harmless (moved once a micro-batch)
        flat: list[torch.Tensor] = []
        for ly, (r, s) in zip(self.layers, rows, strict=True):
            for name in RWKV7_FIELDS:
                t = getattr(ly, name)
                if t is None:  # the first layer's unused value-residual mix
                    t = {"v0": ly.a0, "v1": ly.a1, "v2": ly.a2}[name]
                flat.append(t.t() if name in self.matrices else t)
            flat += [r.view(1, 2, cfg.d_model), s.view(1, cfg.n_head, cfg.head_size, cfg.head_size)]
        x = self.embedding[token]  # [1, C]
        logits = self._token_one(
            x, self.emb_norm, self.emb_norm_b, self.norm_f, self.norm_f_b, self.lm_head.t(), cfg.eps,
            cfg.n_head, *flat,
        )  # fmt: skip
        for il in range(self.n_layer):
            states.write_states(il, flat[(il + 1) * N_PER_LAYER - 2], flat[(il + 1) * N_PER_LAYER - 1])
        return logits

    def _decode_batch(self, tokens: torch.Tensor, ubatch: UBatch, states: StateAccess) -> torch.Tensor | None:
        """One token of each of several sequences (``tokens`` ``[Bs]``): the packed products eagerly, the
        rest through the compiled glue of :mod:`~rsmem.models.ops.wkv_fused`; None (nothing read) when the
        state rows are not float32."""
        cfg = self.config
        rows = [states.read_states(il) for il in range(self.n_layer)]
        if any(r.dtype != torch.float32 or s.dtype != torch.float32 for r, s in rows):
            return None
        n_seqs, c = tokens.shape[0], cfg.d_model
        x = F.layer_norm(self.embedding[tokens], (c,), self.emb_norm, self.emb_norm_b, cfg.eps)
        ffn_out = torch.zeros_like(x)
        v_first: torch.Tensor | None = None
        linear = self.held.linear
        for il, (ly, (r_rows, s_rows)) in enumerate(zip(self.layers, rows, strict=True)):
            shift = r_rows.view(n_seqs, 2, c)
            wkv = s_rows.view(n_seqs, cfg.n_head, cfg.head_size, cfg.head_size)
            x, xr, xw, xk, xv, xa, xg = self._mix(
                x, ffn_out, shift, ly.attn_norm, ly.attn_norm_b, ly.lerp, cfg.eps
            )
            r, k, v = linear(xr, ly.receptance), linear(xk, ly.key), linear(xv, ly.value)
            if v_first is None:  # the first layer: its own values make the value-residual mix exactly v
                v_first = v
            v0, v1, v2 = (ly.a0, ly.a1, ly.a2) if ly.v0 is None else (ly.v0, ly.v1, ly.v2)
            y = self._wkv(
                xw, xv, xa, xg, r, k, v, v_first, wkv, ly.w0, ly.w1, ly.w2, ly.a0, ly.a1, ly.a2, v0, v1, v2,
                ly.g1, ly.g2, ly.k_k, ly.k_a, ly.r_k, ly.ln_x, ly.ln_x_b,
            )  # fmt: skip
            x, xk = self._ffn_in(
                x, linear(y, ly.output), shift, ly.ffn_norm, ly.ffn_norm_b, ly.ffn_lerp_k, cfg.eps
            )
            kf = linear(xk, ly.ffn_key)
            ffn_out = linear(torch.relu_(kf).square_(), ly.ffn_value)
            states.write_states(il, shift, wkv)
        x = output_rows(x + ffn_out, ubatch.output_rows())
        return linear(F.layer_norm(x, (c,), self.norm_f, self.norm_f_b, cfg.eps), self.lm_head)

    def time_mix(
        self,
        ly: Rwkv7Layer,
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
        xr, xw, xk, xv, xa, xg = (x + (prev - x) * ly.lerp.view(6, 1, 1, c)).unbind(0)
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
        g = F.linear(torch.sigmoid(F.linear(xg, ly.g1)), ly.g2)
        kk = F.normalize((k * ly.k_k).view(heads), dim=-1, p=2.0, eps=1e-12)
        k = k * (1 + (a - 1) * ly.k_a)
        rh, kh, vh, ah = (t.view(heads) for t in (r, k, v, a))
        if n_tokens == 1:
            y = wkv7_step_(wkv, rh[:, 0], log_w.view(heads)[:, 0].exp(), kh[:, 0], vh[:, 0], -kk[:, 0],
                           (kk * ah)[:, 0]).unsqueeze(1)  # fmt: skip
        else:
            y = wkv7_chunked_(wkv, rh, log_w.view(heads), kh, vh, -kk, kk * ah, cfg.chunk_size)
        y = F.group_norm(y.reshape(-1, c), cfg.n_head, ly.ln_x, ly.ln_x_b, GROUP_NORM_EPS).view(heads)
        y = y + (rh * kh * ly.r_k.view(cfg.n_head, cfg.head_size)).sum(-1, keepdim=True) * vh
        return self.held.linear(y.reshape(n_seqs, n_tokens, c) * g, ly.output), v_first

    def channel_mix(self, ly: Rwkv7Layer, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        k = torch.relu(self.held.linear(x + (prev - x) * ly.ffn_lerp_k, ly.ffn_key)).square()
        return self.held.linear(k, ly.ffn_value)
