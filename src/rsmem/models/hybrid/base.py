"""What the hybrid models (LFM2, Nemotron-H, Qwen3.5) share (:class:`HybridModelBase`): the matrices held as
:func:`~rsmem.models.hybrid.layers.hold_model` holds them, the memory layout (state rows, the KV cache's
layers), the compile policy and warm-up, the forward around the layers (embedding, final norm, head), and
the decode step (one token of each sequence): the recurrent layers' state rows viewed once, the C++ step
(:mod:`rsmem.models.hybrid.native`) where the model has one and it runs, else the compiled chains, then the
head.

A subclass says how a layer holds its matrices (:meth:`~HybridModelBase.layer_matrices`,
:meth:`~HybridModelBase.set_layer`), runs one layer eagerly (:meth:`~HybridModelBase.layer_forward`), views a
recurrent layer's state rows for the step (:meth:`~HybridModelBase.state_views`), and describes the step as
chains (:meth:`~HybridModelBase.new_chains`, :meth:`~HybridModelBase.chain_steps`,
:meth:`~HybridModelBase.run_chains`) and, where it has one, as the C++ op's blocks
(:meth:`~HybridModelBase.native_blocks`). RoPE and the K-shift default to the layers' ``attention``
(:class:`~rsmem.models.hybrid.layers.Attention`); a model whose attention is another kind overrides
:meth:`~HybridModelBase.rope` and :meth:`~HybridModelBase.k_shift`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.hybrid import native as hybrid_native
from rsmem.models.hybrid.chains import Attend, AttentionStep, Chains
from rsmem.models.hybrid.layers import (
    Attention,
    HeldMatrices,
    HybridStates,
    RopeTables,
    hold_model,
    many_head,
    many_operand,
    one_operand,
    warm_up_decode,
)
from rsmem.models.hybrid.native import NativeBlock
from rsmem.models.ops.common import output_rows
from rsmem.models.ops.norm import rms_norm
from rsmem.models.protocol import StateAccess
from rsmem.models.step.compiled import CompileSetting, resolve_compile
from rsmem.models.step.hybrid_fused import Block

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["HybridConfig", "HybridModelBase", "Operand", "StateFills", "attention_step", "native_attention"]

ChainsT = TypeVar("ChainsT")
Operand = Callable[
    [torch.Tensor], Any
]  # a held [in, out] matrix as a step takes it (one_operand, many_operand)
StateFills = Mapping[int, tuple[torch.Tensor, ...]]  # each recurrent layer's state views, updated in place


class HybridConfig(Protocol):
    """What the shared parts read of a hybrid's config."""

    @property
    def n_layer(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def eps(self) -> float: ...


def attention_step(
    il: int,
    norm: torch.Tensor,
    att: Attention,
    mat: Operand,
    rope: RopeTables | None,
    eps: float,
    out: Block,
    out_tensors: tuple[Any, ...] = (),
) -> AttentionStep:
    """Layer ``il``'s attention as a chain step: ``norm`` then q/k/v (and its q/k norms and RoPE where it has
    them) up to the KV cache; after it, ``out`` on the output product and then ``out_tensors``."""
    assert att.wqkv_t is not None and att.wo_t is not None
    cos, sin = rope if rope is not None else (None, None)
    attn_in = (norm, mat(att.wqkv_t), att.q_norm, att.k_norm, cos, sin)
    consts = (att.n_head, att.n_head_kv, eps)
    return AttentionStep(il, attn_in, consts, att.scale, out, (mat(att.wo_t), *out_tensors))


def native_attention(il: int, norm: torch.Tensor, att: Attention, mat: Operand) -> NativeBlock:
    """Layer ``il``'s attention as the C++ op's block (its KV rows filled each step)."""
    assert att.wqkv_t is not None and att.wo_t is not None
    tensors = (norm, mat(att.wqkv_t), att.q_norm, att.k_norm, mat(att.wo_t), None, None)
    return NativeBlock(hybrid_native.ATTENTION, il, tensors, (att.n_head, att.n_head_kv), att.scale)


class HybridModelBase(Generic[ChainsT]):
    """A hybrid language model for a :class:`~rsmem.memory.hybrid.HybridMemory` (see the module); its
    compiled chains are ``ChainsT`` (one sequence's ``_chains``, several sequences' ``_chains_many``). After
    construction the layers' matrices are the ``[in, out]`` tensors of :class:`HeldMatrices`."""

    arch: ClassVar[str]
    config: HybridConfig
    layers: list[Any]
    _chains: ChainsT
    _chains_many: ChainsT

    def __init__(
        self,
        config: HybridConfig,
        weights: Any,
        *,
        dtype: torch.dtype,
        compile: CompileSetting,
        n_embd_r: int,
        n_embd_s: int,
        kv_widths: Sequence[int],
    ) -> None:
        """``weights``: ``embedding``, ``layers``, ``norm_f`` and ``lm_head`` (the embedding itself when
        tied); ``dtype``: the matrices' and the head's (float32 or bfloat16; the rest is float32);
        ``n_embd_r``, ``n_embd_s``: one sequence's state rows; ``kv_widths``: each layer's key (and value)
        width in the KV cache, 0 for a layer without one; ``compile``: see :meth:`set_compile`."""
        self.config = config
        self.n_vocab = config.n_vocab
        self.n_layer = config.n_layer
        self.n_embd_r, self.n_embd_s = n_embd_r, n_embd_s
        self.tokenizer: Tokenizer | None = None
        self.held = HeldMatrices(dtype)
        self.embedding = weights.embedding.float().contiguous()
        self.norm_f = weights.norm_f.float()
        head = None if weights.lm_head is weights.embedding else weights.lm_head  # None: tied
        self.layers = weights.layers
        per_layer = [self.layer_matrices(ly) for ly in self.layers]
        self.embedding, self.lm_head, held = hold_model(self.held, self.embedding, head, per_layer)
        matrices = [self.lm_head, *(m for mats in held for m in mats)]  # [in, out], the head first
        for ly, mats in zip(self.layers, held, strict=True):
            self.set_layer(ly, mats)
        self.kv_layers: Mapping[int, tuple[int, int]] = {il: (w, w) for il, w in enumerate(kv_widths) if w}
        self._n_matrix_weights = sum(m.numel() for m in matrices)
        # the one-sequence chains stream [out, in] rows: float32 matrices held as views of them
        self._rows_contiguous = all(m.dtype == torch.float32 and m.t().is_contiguous() for m in matrices)
        self.compile_decode = False
        self._native: hybrid_native.HybridNativeStep | None = None
        self.set_compile(compile)

    # ------------------------------------------------------------- the hooks

    def layer_matrices(self, ly: Any) -> list[torch.Tensor]:
        """The layer's ``[out, in]`` matrices to hold."""
        raise NotImplementedError

    def set_layer(self, ly: Any, held: list[torch.Tensor]) -> None:
        """Use the held (``[in, out]``) :meth:`layer_matrices`; vectors float32."""
        raise NotImplementedError

    def is_recurrent_layer(self, il: int) -> bool:
        raise NotImplementedError

    def layer_forward(
        self, il: int, ly: Any, x: torch.Tensor, ubatch: UBatch, states: HybridStates, rope: RopeTables | None
    ) -> torch.Tensor:
        """The residual ``x`` ``[Bs, L, d_model]`` after layer ``il``, eagerly."""
        raise NotImplementedError

    def state_views(self, r: torch.Tensor, s: torch.Tensor, n_seqs: int) -> tuple[torch.Tensor, ...]:
        """A recurrent layer's float32 state rows as its decode step's blocks take them (views)."""
        raise NotImplementedError

    def new_chains(self) -> tuple[ChainsT, ChainsT]:
        """The compiled chains of one sequence and of one token of each of several."""
        raise NotImplementedError

    def chain_steps(self, mat: Operand, many: bool, fills: StateFills, rope: RopeTables | None) -> list[Any]:
        """The decode step's layers as the chains take them, each matrix as ``mat`` gives it."""
        raise NotImplementedError

    def run_chains(
        self,
        chains: ChainsT,
        x: torch.Tensor,
        steps: list[Any],
        tail: str,
        tail_tensors: tuple[Any, ...],
        attend: Attend,
    ) -> torch.Tensor:
        """``chains`` over ``steps`` on the residual ``x``, then ``tail`` on ``tail_tensors`` (``"head"``:
        the logits; ``"norm"``: the normed rows); ``attend`` is the KV cache's part. These are
        :class:`~rsmem.models.hybrid.chains.Chains` unless the model overrides this."""
        return cast(Chains, chains).run(x, steps, tail, tail_tensors, self.config.eps, attend)

    def native_blocks(self, mat: Operand) -> list[NativeBlock] | None:
        """The decode step as the C++ op's blocks (None: the model has none)."""
        return None

    @property
    def native_groups(self) -> int:
        """The op's ``n_group`` (Mamba-2's groups)."""
        return 1

    # ---------------------------------------------------------- memory layout

    def rope(self, ubatch: UBatch) -> RopeTables | None:
        """The micro-batch's RoPE tables (every attention layer has the same; None without RoPE)."""
        first = next((ly.attention for ly in self.layers if ly.attention is not None), None)
        return None if first is None else first.rope_for(ubatch)

    def k_shift(self, il: int, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Stored keys of layer ``il`` moved by ``delta`` positions."""
        attention = self.layers[il].attention
        return rows if attention is None else attention.k_shift(rows, delta)

    # ---------------------------------------------------------------- compile

    def set_compile(self, setting: CompileSetting) -> bool:
        """Whether decode steps run compiled (:mod:`rsmem.models.step.compiled`: ``"auto"``, True/False,
        ``"1"``/``"0"``; None reads ``RSMEM_COMPILE``); only with float32 ``[out, in]`` rows. Returns the
        decision."""
        decided = resolve_compile(setting, self._n_matrix_weights, self.embedding.device)
        self.compile_decode = decided and self._rows_contiguous
        if self.compile_decode and not hasattr(self, "_chains"):
            self._chains, self._chains_many = self.new_chains()
        return self.compile_decode

    def warm_up(self) -> float:
        """Compile the decode steps (one sequence, several) now; the seconds it took (0: not compiling)."""
        return warm_up_decode(self) if self.compile_decode else 0.0

    # ---------------------------------------------------------------- forward

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; ``states`` must be a hybrid memory's context."""
        hybrid = cast(HybridStates, states)  # RecurrentModel's signature; attention needs HybridStates
        tokens = ubatch.token_tensor()  # [Bs, L]
        if self.compile_decode and tokens.shape[1] == 1:
            logits = self._decode(tokens[:, 0], ubatch, hybrid)
            if logits is not None:
                return logits
        rope = self.rope(ubatch)
        x = self.embedding[tokens]  # [Bs, L, d_model]
        for il, ly in enumerate(self.layers):
            x = self.layer_forward(il, ly, x, ubatch, hybrid, rope)
        x = output_rows(x, ubatch.output_rows())
        return self.held.linear(rms_norm(x, self.norm_f, self.config.eps), self.lm_head)

    def swiglu(
        self, x: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        """``x`` plus the SwiGLU of ``rms_norm(x)`` (``gate_up``: gate and up as one held matrix)."""
        g, u = self.held.linear(rms_norm(x, norm, self.config.eps), gate_up).chunk(2, dim=-1)
        return x + self.held.linear(F.silu(g) * u, down)

    # ----------------------------------------------------------------- decode

    def _decode(self, tokens: torch.Tensor, ubatch: UBatch, states: HybridStates) -> torch.Tensor | None:
        """One token of each sequence (``tokens`` ``[Bs]``): the C++ step where it runs, else the compiled
        chains (:meth:`_chains_logits`); None (nothing read) when the state rows are not float32."""
        rows = {il: states.read_states(il) for il in range(self.n_layer) if self.is_recurrent_layer(il)}
        if any(r.dtype != torch.float32 or s.dtype != torch.float32 for r, s in rows.values()):
            return None  # decoded eagerly: reading the rows again is harmless
        n_seqs = tokens.shape[0]
        fills = {il: self.state_views(r, s, n_seqs) for il, (r, s) in rows.items()}
        x = self.embedding[tokens]  # [Bs, d_model]
        rope = self.rope(ubatch)
        twin = partial(self._chains_logits, x, ubatch, states, fills, rope)
        logits = hybrid_native.decode(self._native_step(), x, ubatch, states, fills, rope, twin)
        for il, (r, s) in rows.items():
            states.write_states(il, r, s)  # the rows themselves, updated through their views
        return logits

    def _native_step(self) -> hybrid_native.HybridNativeStep | None:
        """The C++ step over this model's blocks, built at its first use (None: the model has none)."""
        if self._native is None:
            blocks = self.native_blocks(partial(one_operand, self.held))
            if blocks is None:
                return None
            head = one_operand(self.held, self.lm_head)
            eps = self.config.eps
            self._native = hybrid_native.HybridNativeStep(blocks, self.norm_f, head, self.native_groups, eps)
        return self._native

    def _chains_logits(
        self,
        x: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        fills: StateFills,
        rope: RopeTables | None,
    ) -> torch.Tensor:
        """The decode step as compiled chains between the attention layers (:mod:`rsmem.models.hybrid.chains`:
        one sequence's blocks stream ``[out, in]`` rows, several sequences' the few-row kernel's operands);
        attention's KV part is eager; the state views ``fills`` are updated in place."""
        many = x.shape[0] > 1
        mat = partial(many_operand if many else one_operand, self.held)
        steps = self.chain_steps(mat, many, fills, rope)

        def attend(il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            return states.attention(il, q, k, v, scale, ubatch)

        if many:
            h = self.run_chains(self._chains_many, x, steps, "norm", (self.norm_f,), attend)
            return many_head(self.held, output_rows(h, ubatch.output_rows()), self.lm_head)
        head = one_operand(self.held, self.lm_head)
        logits = self.run_chains(self._chains, x, steps, "head", (self.norm_f, head), attend)
        return logits[: len(ubatch.output_rows())]
