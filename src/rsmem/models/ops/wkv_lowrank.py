"""The small low-rank products of RWKV's batched decode steps (the decay, in-context rate, value-residual and
gate mixers: ``[Bs, C] x [C, 32..160]`` and back) on the calling thread only.

Each such product is ~0.1 ms of one core at 64 sequences, but torch's GEMM hands it to every intra-op
thread: two parallel regions a call, each waking the sleeping partner thread and waiting for it at the end
(``OMP_WAIT_POLICY=PASSIVE``, :mod:`rsmem.threads`). RWKV-7 130M has 94 of them a step (plus the bias
``addmm`` copies), 2 threads: 4 voluntary context switches a call, ~470 of the step's ~630; on a loaded
machine each hand-off waits for the scheduler. :func:`matmul_one_thread` runs ``a @ b`` with torch's thread
count set to one around it (an op that compiled steps call as it is, so inductor fuses the bias and
activations around it instead of emitting ``addmm``); its reference twin is ``a @ b``.

The thread count is process-wide state (OpenMP's count of the calling thread, MKL's): another thread
running torch ops during the product could see one thread for that long, which costs speed, never results.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("rsmem::matmul_one_thread", mutates_args=())
def matmul_one_thread(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (any shapes :func:`torch.matmul` takes) computed on the calling thread alone."""
    n = torch.get_num_threads()
    if n == 1:
        return torch.matmul(a, b)
    torch.set_num_threads(1)
    try:
        return torch.matmul(a, b)
    finally:
        torch.set_num_threads(n)


@matmul_one_thread.register_fake
def _matmul_one_thread_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def lowrank(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (``weight`` ``[out, in]``, no bias) on one thread
    (:func:`matmul_one_thread`)."""
    return matmul_one_thread(x, weight.t())
