"""The small low-rank products of RWKV's batched decode steps (the decay, in-context rate, value-residual and
gate mixers: ``[Bs, C] x [C, 32..160]`` and back) on the calling thread only, and RWKV-7's chunk systems'
inverse (:func:`unit_lower_inverse_one_thread`, its chunked prefill; the loop over the chunks runs under
:func:`rsmem.threads.one_thread_below`).

Each such product is a small fraction of a step's work, but torch's GEMM hands it to every intra-op
thread: two parallel regions a call, each waking the sleeping partner thread and waiting for it at the end
(``OMP_WAIT_POLICY=PASSIVE``, :mod:`rsmem.threads`). RWKV-7 130M has 94 of them a step (plus the bias
``addmm`` copies), so these hand-offs make most of the step's context switches; on a loaded machine each
hand-off waits for the scheduler. :func:`matmul_one_thread` runs ``a @ b`` with torch's thread
count set to one around it (an op that compiled steps call as it is, so inductor fuses the bias and
activations around it instead of emitting ``addmm``); its reference twin is ``a @ b``.

The thread count is process-wide state (OpenMP's count of the calling thread, MKL's): another thread
running torch ops during the product could see one thread for that long, which costs speed, never results.
"""

from __future__ import annotations

import torch

from rsmem.threads import one_thread_below


@torch.library.custom_op("rsmem::matmul_one_thread", mutates_args=())
def matmul_one_thread(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (any shapes :func:`torch.matmul` takes) computed on the calling thread alone."""
    with one_thread_below(0, 1):
        return torch.matmul(a, b)


@matmul_one_thread.register_fake
def _matmul_one_thread_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def lowrank(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (``weight`` ``[out, in]``, no bias) on one thread
    (:func:`matmul_one_thread`)."""
    return matmul_one_thread(x, weight.t())


@torch.library.custom_op("rsmem::unit_lower_inverse_one_thread", mutates_args=())
def unit_lower_inverse_one_thread(a: torch.Tensor) -> torch.Tensor:
    """``(I - a)^-1`` of strictly lower-triangular ``a`` ``[B, T, T]`` (``torch.linalg.solve_triangular``,
    its reference twin) on the calling thread: the batched solve hands each small system to the intra-op
    threads, and with them sleeping between regions (``OMP_WAIT_POLICY=PASSIVE``) waking them costs far more
    than the solves (RWKV-7's chunked prefill: one call a layer)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    with one_thread_below(0, 1):
        return torch.linalg.solve_triangular(eye - a, eye.expand_as(a), upper=False, unitriangular=True)


@unit_lower_inverse_one_thread.register_fake
def _unit_lower_inverse_fake(a: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(a)
