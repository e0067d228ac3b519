"""Compiled decode steps: when ``torch.compile`` (inductor) runs the one-token forward, and doing so safely.

A decode step is dozens of tiny ops per layer; eagerly their dispatch costs as much as the arithmetic, and a
one-sequence step spends most of its time streaming weights. The functions of
:mod:`rsmem.models.step.fused` compiled by inductor make a few C++ kernels of them (a one-sequence token is
one compiled call: every block and the head), which makes
decode of one or many sequences and Mamba's prefill (through compiled scan blocks) faster than eager
(``bench/throughput.py`` compares them).

Policy (``compile=`` of :func:`rsmem.load_model`, else the ``RSMEM_COMPILE`` environment variable):
``"auto"`` (the default) compiles for CPU models with at least ``AUTO_MIN_WEIGHTS`` matrix weights when a
C++ compiler is on the PATH (compiling costs seconds at the first decode step, which a tiny model never wins
back); ``"1"``/True always, ``"0"``/False never. Of prefill only Mamba's scan is compiled (Mamba-2's SSD
is made of large products already).

Safety: a compiled function is first run with zero stand-ins for the arguments it writes (weights are
passed as they are), never on the memory's rows, so a machine where compiling fails (no compiler, an
inductor bug) falls back to the eager path with a
warning before any state was touched. Each variant (one sequence; several sequences, with a dynamic batch
size so that continuous batching does not recompile) is compiled once per model shape; the first call of
one raises torch's per-function recompile limit to ``RECOMPILE_LIMIT`` (a process-wide dynamo setting).

The GIL: inductor calls its C++ kernels through Python bindings that keep the GIL for the whole kernel
(torch 2.13's ``CppPythonBindingsCodeCache``), so while a compiled step runs no other Python thread can
(``rsmem serve``'s event loop waits for every step). A ``CompiledStep``'s first call makes the bindings
release the GIL around each kernel once its arguments are read (:func:`release_gil_in_kernels`,
process-wide: the kernels are plain C++ loops over raw pointers and call nothing in Python).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from rsmem import settings
from rsmem.threads import unraised_threads

# Models with fewer matrix weights than this decode eagerly under "auto" (the default model has ~2.5M).
AUTO_MIN_WEIGHTS = 16 << 20
# Compilations torch keeps per function (its default is 8): each model shape in a process needs a few
# (one sequence, a dynamic batch), and tests or a server may hold several models.
RECOMPILE_LIMIT = 64
# Inductor options for rsmem's steps. The whole one-sequence step has ~270 inputs and ~200 intermediate
# buffers: the generated Python wrapper's checks of each input's size and alignment are a visible part of
# a token's time, and dynamo's guards already check shapes and strides before the call.
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
# Mamba-2's and the hybrids' decode steps keep their glue (norms, the short convolution, gates, SwiGLU:
# [Bs, <= 3d]) on the calling thread: inductor runs a kernel on one thread when each thread's share would
# be under this many elements (its default is 512). A parallel region over a few thousand elements costs
# more in its hand-off than it saves, and on a shared machine the other thread may wait for a core (a server
# beside its own client then spends most of its engine thread's time in the compiled step's barriers).
# The products (their own kernels) and Mamba-2's state update ([Bs, H, P, N]: 32,768 a sequence
# in the embedded model, 196,608 at 130M) stay parallel.
GLUE_MIN_CHUNK = 1 << 16

# A step whose products all run on rsmem's own workers (the few-row kernel: kernels/csrc/pool.h) keeps every
# inductor kernel on the calling thread, Mamba-2's state update included: each parallel region of inductor's
# would wake torch's sleeping OpenMP thread, which costs a one-sequence step more than the parallel
# glue and reductions save.
ONE_THREAD_GLUE = {"cpp.min_chunk_size": 1 << 24}

CompileSetting = bool | str | None


def has_cxx_compiler() -> bool:
    """Whether inductor can build its C++ kernels here (``$CXX``, else ``g++``, ``c++`` or ``clang++``)."""
    return any(c and shutil.which(c) for c in settings.cxx_candidates())


def resolve_compile(setting: CompileSetting, n_matrix_weights: int, device: torch.device) -> bool:
    """The decision for one model: ``setting`` (None reads ``RSMEM_COMPILE``, default ``"auto"``)."""
    if setting is None:
        setting = settings.compile_setting()
    if isinstance(setting, str):
        value = setting.strip().lower()
        if value in ("1", "true", "on", "yes"):
            setting = True
        elif value in ("0", "false", "off", "no"):
            setting = False
        elif value == "auto":
            return device.type == "cpu" and n_matrix_weights >= AUTO_MIN_WEIGHTS and has_cxx_compiler()
        else:
            raise ValueError(f"compile setting must be auto, 1 or 0, got {setting!r}")
    return bool(setting) and hasattr(torch, "compile")


def zeros_mirroring(t: torch.Tensor, extra_rows: int = 0) -> torch.Tensor:
    """Zeros that pass the same compile guards as ``t``: its strides (a split view keeps its row stride),
    dtype, device and inference-ness (weights are normal tensors, activations inference tensors), with
    ``extra_rows`` more rows in dimension 0."""
    with torch.inference_mode(t.is_inference()):
        shape = (t.shape[0] + extra_rows, *t.shape[1:]) if t.dim() else t.shape
        return torch.empty_strided(shape, t.stride(), dtype=t.dtype, device=t.device).zero_()


R = TypeVar("R")  # what the compiled function returns: a tensor or a tuple of them


class CompiledStep(Generic[R]):
    """One function of :mod:`rsmem.models.step.fused` under ``torch.compile``, checked before first use.

    ``batch_args``: positions of the arguments whose dimension 0 is the batch. When given, that dimension is
    marked dynamic, so every batch size of two or more shares one compilation; otherwise shapes are static
    (the one-sequence variants). ``mutated``: the positions of the arguments the function writes (or a
    predicate on the position); only those and the batch arguments get zero stand-ins for the first,
    checking run, the rest (weights) are passed as they are, so checking never copies a model.
    """

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        batch_args: tuple[int, ...] = (),
        mutated: tuple[int, ...] | Callable[[int], bool] = (),
        options: dict[str, Any] | None = None,
    ) -> None:
        """``options``: inductor options beside :data:`INDUCTOR_OPTIONS` (e.g. ``cpp.min_chunk_size``)."""
        self.fn = fn
        self.batch_args = batch_args
        self._mutated = mutated if callable(mutated) else mutated.__contains__
        self.options = {**INDUCTOR_OPTIONS, **(options or {})}  # what inductor compiles with
        self._compiled: Callable[..., R] | None = None  # made at the first call (see _compiled_fn)
        self.failed: BaseException | None = None
        self._checked = False
        self._dynamic = False  # compiled once with the batch dimension marked dynamic

    def check(self, args: tuple[Any, ...]) -> bool:
        """Compile by running on zero stand-ins for the written and batch arguments (the memory's rows stay
        untouched); False, and a warning, when that fails. Runs once."""
        if not self._checked:
            self._checked = True
            dummy = tuple(
                zeros_mirroring(a, extra_rows=1 if i in self.batch_args else 0)
                if isinstance(a, torch.Tensor) and (i in self.batch_args or self._mutated(i))
                else a
                for i, a in enumerate(args)
            )
            try:
                self._call(dummy)
            except Exception as exc:  # no compiler, or an inductor failure: decode eagerly instead
                self.failed = exc
                warnings.warn(
                    f"rsmem: torch.compile of {self.fn.__name__} failed, decoding eagerly: {exc}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return self.failed is None

    def _compiled_fn(self) -> Callable[..., R]:
        """``torch.compile`` of the function, made at the first call: dynamo and inductor are imported
        then, so a process whose steps never reach a compiled function (the C++ step takes its decode)
        never holds their modules."""
        if self._compiled is None:
            release_gil_in_kernels()
            dynamic = None if self.batch_args else False
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=dynamic, options=self.options)
            if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
                torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        return self._compiled

    def _call(self, args: tuple[Any, ...]) -> R:
        compiled = self._compiled_fn()
        if not self._dynamic:  # once compiled with a symbolic batch size, every later size matches it
            for i in self.batch_args:
                torch._dynamo.mark_dynamic(args[i], 0)
        with unraised_threads():  # dynamo guards on the thread count: a raised one would compile again
            out = compiled(*args)
        self._dynamic = bool(self.batch_args)
        return out

    def __call__(self, *args: Any) -> R:
        """The compiled function when it works here, else the eager one (same results)."""
        if self.check(args):
            try:
                return self._call(args)
            except torch._dynamo.exc.FailOnRecompileLimitHit as exc:  # raised before anything ran
                self.failed = exc
                warnings.warn(
                    f"rsmem: {self.fn.__name__} needs more than {RECOMPILE_LIMIT} compilations in this "
                    "process, running it eagerly from now on",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.fn(*args)


# torch's binding calls the kernel holding the GIL; the replacement reads the arguments (Python objects) with
# the GIL, then runs the kernel without it (a C++ exception takes the GIL back before it propagates).
_TORCH_KERNEL_CALL = "kernel({}); Py_RETURN_NONE;"
_GIL_FREE_KERNEL_CALL = (
    "[&](auto... a) {{ PyThreadState* s = PyEval_SaveThread(); "
    "try {{ kernel(a...); }} catch (...) {{ PyEval_RestoreThread(s); throw; }} "
    "PyEval_RestoreThread(s); }}({}); Py_RETURN_NONE;"
)


def release_gil_in_kernels() -> bool:
    """Make inductor's C++ kernels compiled from now on in this process run without the GIL; True when they
    do. Only torch's known binding is replaced (another torch version's is left as it is: False). The
    binding is part of each kernel's source, so kernels built before or cached with the old binding are
    never mixed up with these."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings
    except ImportError:
        return False
    if Bindings.call_entry_function == _TORCH_KERNEL_CALL:
        Bindings.call_entry_function = _GIL_FREE_KERNEL_CALL
    return Bindings.call_entry_function == _GIL_FREE_KERNEL_CALL
