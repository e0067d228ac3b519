"""Decode steps and Mamba scan blocks written for ``torch.compile`` to fuse
(:mod:`rsmem.models.step.compiled`).

Each function is plain torch and correct eagerly (the tests run them both ways); the way they are written
is chosen for what inductor makes of them on a CPU:

- :func:`gemv` writes a one-row product as multiply-and-sum, which inductor turns into one reduction kernel
  streaming the ``[out, in]`` matrix on every core. A one-sequence decode step is bound by reading the
  weights; this kernel reads them as fast as oneDNN's product, inside the layer's kernel,
  with no call per matrix.
- The state updates never read the new state back: the output ``y_t = C_t . h_t`` is expanded into
  ``C_t . (dA h_{t-1}) + (C_t . B_t) dt_t x_t``, a reduction over the *old* state that inductor fuses with
  the in-place store of the new one. Each state row is then read from memory once and written once per
  step (the form that reduces over ``h_t`` stores it to a temporary, writes it again, and reads it back:
  three passes over memory instead of one).
- :func:`token_step` chains the one-sequence blocks and the head into one function: one compiled call a
  token. :func:`token_step_many` does the same for several sequences (one token each), its products
  :func:`matmul_rows` (an extern GEMM call inside the compiled code), with a dynamic batch size.
- :func:`mamba_scan_block` is Mamba's recurrence over 16 tokens as plain steps, unrolled by inductor.

Shapes: ``x`` is the residual stream ``[Bs, d_model]``; matrices are ``[out, in]`` (any strides); ``window``
``[Bs, C, K-1]`` and ``h`` are the state views the model hands the mixer, updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.models.ops.common import CapturePoints
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.norm import gated_group_rms_norm, rms_norm
from rsmem.models.ops.quantized import Matrix, QuantMatrix


def gemv(x: torch.Tensor, weight: Matrix) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[Bs, in]`` and ``weight`` ``[out, in]`` as a fused reduction (meant for
    ``Bs`` = 1: eagerly it materialises ``[Bs, out, in]``). A bf16 ``weight`` is promoted per element; a
    :class:`~rsmem.models.ops.quantized.QuantMatrix` goes to its kernel (an op inductor calls as it is), a
    :class:`SmallRows` to the C++ few-row kernel (:func:`matmul_rows`)."""
    if isinstance(weight, QuantMatrix):
        return weight.matmul_t(x)
    if isinstance(weight, SmallRows):
        return matmul_rows(x, weight)
    return (weight * x.unsqueeze(-2)).sum(-1)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    return out


def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


# rsmem::packed_linear(x, packed): oneDNN's product with a packed [out, in] matrix (ops.packed) as an op
# inductor calls as it is (its own lowering of mkldnn._linear_pointwise expects the matrices it packed).
_lib = torch.library.Library("rsmem", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor packed) -> Tensor")
_lib.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("rsmem::packed_linear", _packed_linear_fake, lib=_lib)


class Packed:
    """A oneDNN packed ``[out, in]`` matrix (:meth:`~rsmem.models.step.packed.PackedMatrices.twin`) as
    :func:`matmul_rows` takes it (inside a compiled function a packed tensor cannot be told from a plain one
    by its layout; this type can)."""

    __slots__ = ("packed",)

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed


class SmallRows:
    """A float32 ``[out, in]`` matrix with rows contiguous (``plain``) and its oneDNN packed twin, as
    :func:`matmul_rows` takes it: up to ``max_rows`` rows through the C++ few-row kernel
    (``rsmem_native::rows_linear``, see :mod:`rsmem.models.step.small_rows`, which makes these only once the
    kernels are loaded), more through the twin, in one op (no guard on the row count in a compiled step)."""

    __slots__ = ("max_rows", "packed", "plain")

    def __init__(self, plain: torch.Tensor, packed: torch.Tensor, max_rows: int) -> None:
        self.plain = plain
        self.packed = packed
        self.max_rows = max_rows


RowsOperand = Matrix | Packed | SmallRows
Product = Callable[[torch.Tensor, Any], torch.Tensor]  # gemv (a Matrix) or matmul_rows (a RowsOperand)


def matmul_rows(x: torch.Tensor, weight: RowsOperand) -> torch.Tensor:
    """``x @ weight.T`` for several rows ``x`` ``[Bs, in]`` and ``weight`` ``[out, in]``, float32. A
    :class:`Packed` matrix goes through ``rsmem::packed_linear`` (ahead of the plain GEMM for 4-64 rows), a
    :class:`SmallRows` through the few-row kernel or its packed twin by the row count; a
    plain one is a GEMM; a bf16 ``weight`` multiplies ``x`` rounded to bf16, as
    :func:`~rsmem.models.ops.common.linear` does; a :class:`~rsmem.models.ops.quantized.QuantMatrix` goes to
    its kernel."""
    if isinstance(weight, QuantMatrix):
        return weight.matmul_t(x)
    if isinstance(weight, Packed):
        out: torch.Tensor = torch.ops.rsmem.packed_linear(x, weight.packed)
        return out
    if isinstance(weight, SmallRows):
        out = torch.ops.rsmem_native.rows_linear(x, weight.plain, weight.packed, weight.max_rows)
        return out
    if weight.dtype == x.dtype:
        return x @ weight.t()
    return (x.to(weight.dtype) @ weight.t()).float()


def conv_step_(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """One token of the causal depthwise conv, then SiLU: ``x`` ``[Bs, C]``; ``window`` ``[Bs, C, K-1]`` is
    shifted in place; returns ``[Bs, C]``."""
    return F.silu(causal_conv1d_(x.unsqueeze(1), window, weight, bias)[:, 0])


# ---------------------------------------------------------------------------------------------- Mamba


def mamba_ssm_step_(
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    xc: torch.Tensor,
    z: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
) -> torch.Tensor:
    """Mamba's selective state update for one token, gated: ``dt`` (after its softplus), ``xc`` and ``z``
    ``[Bs, D]``, ``B`` and ``C`` ``[Bs, N]``, ``h`` ``[Bs, D, N]`` updated in place; returns
    ``y * silu(z)``."""
    dA = torch.exp(dt.unsqueeze(-1) * A)  # [Bs, D, N]
    dtx = dt * xc
    y = (h * dA * C.unsqueeze(1)).sum(-1) + dtx * (B * C).sum(-1, keepdim=True) + D * xc
    h.copy_(h * dA + dtx.unsqueeze(-1) * B.unsqueeze(1))
    return y * F.silu(z)


def mamba_layer_(
    product: Product,
    x: torch.Tensor,
    norm: torch.Tensor,
    in_proj: RowsOperand,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor,
    x_proj: RowsOperand,
    dt_proj: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    out_proj: RowsOperand,
    window: torch.Tensor,
    h: torch.Tensor,
    eps: float,
    dt_rank: int,
    d_state: int,
) -> torch.Tensor:
    """A whole Mamba block for one token of each sequence, its four products through ``product``
    (:func:`gemv` or :func:`matmul_rows`); returns the new ``x``."""
    d_inner = conv_weight.shape[0]
    xz = product(rms_norm(x, norm, eps), in_proj)
    xc = conv_step_(xz[:, :d_inner], window, conv_weight, conv_bias)
    dt_low, B, C = product(xc, x_proj).split([dt_rank, d_state, d_state], dim=-1)
    # dt_proj [D, R] through ``product`` too: for one sequence a reduction on the calling thread (an
    # extern GEMM here would wake torch's sleeping OpenMP threads for a tiny product)
    dt = F.softplus(product(dt_low, dt_proj) + dt_bias)
    y = mamba_ssm_step_(dt, B, C, xc, xz[:, d_inner:], A, D, h)
    return x + product(y, out_proj)


def mamba_layer_one_(*args: Any) -> torch.Tensor:
    """:func:`mamba_layer_` for one sequence's token (every product a :func:`gemv`)."""
    return mamba_layer_(gemv, *args)


def mamba_layer_many_(*args: Any) -> torch.Tensor:
    """:func:`mamba_layer_` for one token of each of several sequences (products :func:`matmul_rows`)."""
    return mamba_layer_(matmul_rows, *args)


# Tokens a compiled scan block advances: 16 steps unrolled into one kernel (compiles in a few seconds).
SCAN_BLOCK = 16


def mamba_scan_block(
    h: torch.Tensor, dt: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan over a few tokens as plain steps, for inductor to unroll into one loop nest over
    ``(d, n)`` that carries the state in registers: ``h`` ``[Bs, D, N]``, ``dt`` (after softplus) and ``x``
    ``[Bs, T, D]``, ``B``, ``C`` ``[Bs, T, N]``; returns ``(y [Bs, T, D] without the D skip, new h)``.

    Unlike the chunked scan's cumulative sums this costs the same whatever the decay: random-weight
    models, whose large ``dt`` cut the chunked scan's chunks to one or two tokens, gain the most."""
    ys = []
    for t in range(dt.shape[1]):
        h = h * torch.exp(dt[:, t, :, None] * A) + (dt[:, t] * x[:, t]).unsqueeze(-1) * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, dim=1), h


def selective_scan_blocked_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    block: Callable[..., tuple[torch.Tensor, torch.Tensor]] = mamba_scan_block,
) -> torch.Tensor:
    """:func:`~rsmem.models.ops.selective_scan.selective_scan_` as a loop over ``SCAN_BLOCK``-token blocks
    of ``block`` (the compiled :func:`mamba_scan_block`); updates ``h`` in place, returns ``y``
    ``[Bs, L, D]`` (see :func:`selective_scan_blocked_at_`)."""
    return selective_scan_blocked_at_(x, dt, A, B, C, D, h, (), block)[0]


def selective_scan_blocked_at_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    at: CapturePoints,
    block: Callable[..., tuple[torch.Tensor, torch.Tensor]] = mamba_scan_block,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selective_scan_blocked_`, also returning the states after the points of ``at`` (``(b, t)``:
    sequence ``b`` after its token ``t``): ``(y [Bs, L, D], [len(at), D, N])``.

    A block also ends after each point's token (so a point costs at most one more block); a block shorter
    than ``SCAN_BLOCK`` is padded with ``dt = 0``, which leaves the state exactly as it is."""
    n_tokens = x.shape[1]
    h_at = h.new_empty(len(at), *h.shape[1:])
    cuts = sorted({t + 1 for _, t in at})
    # Every block gets fresh tensors with the same strides and kind whatever the prompt length (a slice's
    # strides depend on it, even along a size-1 batch dimension): one compilation serves every prompt.
    state, ys = h.clone(), []
    i = 0
    while i < n_tokens:
        j = min([i + SCAN_BLOCK, n_tokens, *(c for c in cuts if c > i)])
        dt_b, x_b, B_b, C_b = (_block_of(t, i, j) for t in (dt, x, B, C))
        y, state = block(state, dt_b, x_b, A, B_b, C_b)
        ys.append(y[:, : j - i] if j - i < SCAN_BLOCK else y)
        for k, (b, t) in enumerate(at):
            if t == j - 1:
                h_at[k] = state[b]
        i = j
    h.copy_(state)
    y = torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]
    return torch.addcmul(y, D, x), h_at


def _block_of(t: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """Tokens ``[i, j)`` of ``t`` ``[Bs, L, ...]`` as a fresh ``[Bs, SCAN_BLOCK, ...]`` tensor, zero after
    ``j - i`` tokens."""
    if j - i == SCAN_BLOCK:
        return torch.empty(t[:, i:j].shape, dtype=t.dtype).copy_(t[:, i:j])
    out = t.new_zeros(t.shape[0], SCAN_BLOCK, *t.shape[2:])
    out[:, : j - i] = t[:, i:j]
    return out


# -------------------------------------------------------------------------------------------- Mamba-2


def mamba2_mixer_step_(
    zxbcdt: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm_norm: torch.Tensor,
    h: torch.Tensor,
    n_group: int,
    eps: float,
) -> torch.Tensor:
    """Mamba-2's mixer between its two projections, for one token: ``zxbcdt`` ``[Bs, d_inner + conv_dim +
    H]`` (``in_proj``'s output); ``window`` and ``h`` ``[Bs, H, P, N]`` updated in place; returns the gated,
    group-normalised ``y`` ``[Bs, d_inner]``."""
    n_seqs, n_head, head_dim, d_state = h.shape
    d_inner = n_head * head_dim
    conv_dim = conv_weight.shape[0]
    z, xBC, dt = zxbcdt.split([d_inner, conv_dim, n_head], dim=-1)
    xBC = conv_step_(xBC, window, conv_weight, conv_bias)
    x, B, C = xBC.split([d_inner, n_group * d_state, n_group * d_state], dim=-1)
    rep = n_head // n_group
    x = x.reshape(n_seqs, n_head, head_dim)
    B, C = (  # [Bs, H, N]: each group's B and C for the heads that share it
        t.reshape(n_seqs, n_group, 1, d_state).expand(-1, -1, rep, -1).reshape(n_seqs, n_head, d_state)
        for t in (B, C)
    )
    dt = F.softplus(dt + dt_bias)  # [Bs, H]
    dA = torch.exp(dt * A).unsqueeze(-1)  # [Bs, H, 1]
    xdt = x * dt.unsqueeze(-1)  # [Bs, H, P]
    hC = (h * C.unsqueeze(2)).sum(-1)  # [Bs, H, P], from the old state
    y = hC * dA + xdt * (B * C).sum(-1, keepdim=True) + x * D.unsqueeze(-1)
    h.copy_(h * dA.unsqueeze(-1) + xdt.unsqueeze(-1) * B.unsqueeze(2))
    return gated_group_rms_norm(y.reshape(n_seqs, d_inner), z, ssm_norm, n_group, eps)


def mamba2_layer_(
    product: Product,
    x: torch.Tensor,
    norm: torch.Tensor,
    in_proj: RowsOperand,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm_norm: torch.Tensor,
    out_proj: RowsOperand,
    window: torch.Tensor,
    h: torch.Tensor,
    n_group: int,
    eps: float,
) -> torch.Tensor:
    """A whole Mamba-2 block for one token of each sequence, both products through ``product``
    (:func:`gemv` or :func:`matmul_rows`); returns the new ``x``."""
    zxbcdt = product(rms_norm(x, norm, eps), in_proj)
    y = mamba2_mixer_step_(zxbcdt, window, conv_weight, conv_bias, dt_bias, A, D, ssm_norm, h, n_group, eps)
    return x + product(y, out_proj)


def mamba2_layer_one_(*args: Any) -> torch.Tensor:
    """:func:`mamba2_layer_` for one sequence's token (both products :func:`gemv`)."""
    return mamba2_layer_(gemv, *args)


def mamba2_layer_many_(*args: Any) -> torch.Tensor:
    """:func:`mamba2_layer_` for one token of each of several sequences (products :func:`matmul_rows`)."""
    return mamba2_layer_(matmul_rows, *args)


def head_one(x: torch.Tensor, norm_f: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """Final norm and LM head for one row: ``[1, d_model]`` -> ``[1, n_vocab]`` logits."""
    return gemv(rms_norm(x, norm_f, eps), lm_head)


def token_step(
    layer_one: Callable[..., torch.Tensor], n_fields: int, consts: tuple[float | int, ...]
) -> Callable[..., torch.Tensor]:
    """A whole one-sequence decode step as one function, ``(x, norm_f, lm_head, eps, *flat) -> logits``:
    ``layer_one`` over each layer's ``n_fields`` tensors of ``flat`` (then ``consts``), the final norm and
    the head. Compiled, it is one call a token instead of one a layer: what each call costs in
    dynamo and Python is a visible share of a 130M model's token."""

    def token_step_one(
        x: torch.Tensor, norm_f: torch.Tensor, lm_head: torch.Tensor, eps: float, *flat: torch.Tensor
    ) -> torch.Tensor:
        for i in range(0, len(flat), n_fields):
            x = layer_one(x, *flat[i : i + n_fields], *consts)
        return head_one(x, norm_f, lm_head, eps)

    return token_step_one


def token_step_many(
    layer_many: Callable[..., torch.Tensor], n_fields: int, consts: tuple[float | int, ...]
) -> Callable[..., torch.Tensor]:
    """:func:`token_step` for one token of each of several sequences: ``layer_many`` (a ``*_layer_many_``
    block) over each layer, the final norm and the head of every row, ``(x [Bs, d_model], norm_f, lm_head,
    eps, *flat) -> [Bs, n_vocab]``. Compiled with a dynamic ``Bs``, a step of any width is one call: the
    per-layer path (packed products eagerly, a compiled mixer between them) paid dynamo's and Python's
    cost for each of them."""

    def token_step_many(
        x: torch.Tensor, norm_f: torch.Tensor, lm_head: RowsOperand, eps: float, *flat: torch.Tensor
    ) -> torch.Tensor:
        for i in range(0, len(flat), n_fields):
            x = layer_many(x, *flat[i : i + n_fields], *consts)
        return matmul_rows(rms_norm(x, norm_f, eps), lm_head)

    return token_step_many
