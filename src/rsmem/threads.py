"""How many threads torch gives a model, and an OpenMP wait policy that does not spin against a neighbour.

**Wait policy.** torch's OpenMP (libgomp) threads spin after each parallel region, waiting for the next
one. On a machine where another process wants the same cores, a spinning thread holds a core its partner
needs, so every parallel region waits for the scheduler, and a small model's steps take many times longer
than with idle threads that sleep. ``import rsmem`` therefore sets ``OMP_WAIT_POLICY=PASSIVE`` before torch
loads, unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` or ``RSMEM_OMP_PASSIVE=0``
(:func:`rsmem.settings.prepare_openmp_environment`). libgomp reads the variable once, when torch is
first imported: a program that imports torch before rsmem keeps torch's spinning default (:func:`wait_policy`
says ``"too late"``) and should set ``OMP_WAIT_POLICY=PASSIVE`` in its environment, or import rsmem first.

**Threads by the work.** With idle threads that sleep, a second thread pays off for every model and batch
size, busy or not, even the embedded model's 8-token chunks (``bench/threads.py`` compares them): under
contention a process with two runnable threads also gets two shares of the scheduler. With spinning threads
(torch imported before rsmem, or the user's own spinning policy) a small model's products are too small to
repay a hand-off that may wait for a whole scheduler slice, so one thread beats two. So :func:`auto_threads`
gives all cores (torch's default count at import) when OpenMP waits passively, and otherwise one thread to
models narrower than :data:`SMALL_MODEL_WIDTH`. :func:`use_threads` applies it when a model loads
(``rsmem.load_model``, the command line); ``threads=`` / ``-t`` / ``RSMEM_THREADS`` override. The count is
process-wide (``torch.set_num_threads``): the last model loaded sets it. Choosing per call instead
(``set_num_threads`` around small batches) would be cheap, also when it alternates around small products with
sleeping threads, but it belongs in the models' step code, and with sleeping threads no batch size would
choose one thread.

**Prompts beside a busy process.** torch splits a prompt's products statically between its threads, so a
parallel region ends with the thread that shares its core with the neighbour: with one thread a core and one
busy process, a prefill runs at the speed of one thread alone. While another process's thread is runnable
(``/proc/loadavg``, cheap to read: its runnable count is one on a quiet machine and two beside one busy
process) :func:`prompt_threads` gives a prompt's micro-batch twice the cores in threads, so each core holds
two of rsmem's threads and the scheduler's fair share goes to rsmem twice; the extra threads would cost a
quiet machine some speed, so they come only beside a neighbour. Only with the automatic count and sleeping
threads; ``RSMEM_BUSY_THREADS=0`` turns it off. Compiled functions inside the block run at the count before
the raise
(:func:`unraised_threads`: dynamo guards on the count).

**The decode products** do not use torch's threads: rsmem's own workers (``kernels/csrc/pool.h``) share
them, waiting between products in a spin that yields the core to any other thread and is skipped after the
process was preempted (``RSMEM_SPIN_US``; :func:`product_workers` says which policy is in force).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rsmem import settings

if TYPE_CHECKING:
    from rsmem.models.protocol import RecurrentModel

# runs when rsmem is imported, before rsmem imports torch (rsmem/__init__.py imports this module first)
_WAIT_POLICY = settings.prepare_openmp_environment()
_PASSIVE = settings.openmp_waits_passively()

# with spinning OpenMP threads, models whose hidden size is below this run on one thread: at the embedded
# model's width (d_model 256) one thread outruns two spinning ones; the 130M configs (d_model 768) are
# left on all cores, where a quiet machine gains from the second thread
SMALL_MODEL_WIDTH = 512

_all_cores: int | None = None
_auto_count = False  # whether use_threads chose the count itself (no threads=, -t or RSMEM_THREADS)
_raised_from: int | None = None  # the count prompt_threads raised torch's from, while it is raised

# micro-batches with at least this many tokens a sequence are prompt work for prompt_threads
PROMPT_TOKENS = 32
LOADAVG = "/proc/loadavg"


def restore_environment() -> None:
    """``OMP_WAIT_POLICY`` out of ``os.environ`` again once torch has loaded, when rsmem put it there: child
    processes (another program, a benchmark's llama.cpp) keep their own default."""
    settings.restore_openmp_environment(_WAIT_POLICY)


def wait_policy() -> str:
    """Who chose how OpenMP's idle threads wait in this process: ``passive`` (rsmem set it), ``user`` (the
    user's ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``), ``off`` (``RSMEM_OMP_PASSIVE=0``) or ``too late``
    (torch was imported before rsmem, with the environment's policy: spinning unless it said otherwise)."""
    return _WAIT_POLICY


def waits_passively() -> bool:
    """Whether OpenMP's idle threads sleep at once in this process (as far as the environment says)."""
    return _PASSIVE


def product_workers() -> str:
    """How this process threads its decode products (``kernels/csrc/pool.h``): rsmem's workers and their
    wait (``RSMEM_SPIN_US``), torch's OpenMP threads, or the reference twins when the kernels are not loaded
    (this never builds them)."""
    from rsmem.kernels.build import loaded_native_ops

    ops = loaded_native_ops()
    if ops is None:
        return "torch's (the C++ kernels are not loaded)"
    spin = int(ops.pool_stats()[0])
    if spin < 0:
        return "torch's OpenMP threads (RSMEM_SPIN_US < 0)"
    if spin == 0:
        return "rsmem's workers, sleeping at once (RSMEM_SPIN_US=0)"
    return f"rsmem's workers, spinning up to {spin} us while the core is idle (RSMEM_SPIN_US)"


def all_cores() -> int:
    """torch's own thread count as it was before rsmem changed it (its default: the physical cores)."""
    global _all_cores
    if _all_cores is None:
        import torch

        _all_cores = torch.get_num_threads()
    return _all_cores


def model_width(model: RecurrentModel) -> int | None:
    """The model's hidden size (``config.d_model`` / ``n_embd`` / ``hidden_size``), None if unknown."""
    cfg = getattr(model, "config", None)
    for key in ("d_model", "n_embd", "hidden_size"):
        value = getattr(cfg, key, None)
        if isinstance(value, int):
            return value
    return None


def auto_threads(model: RecurrentModel, passive: bool | None = None) -> int:
    """All cores when OpenMP waits passively (``passive``: default this process's policy); with spinning
    threads one thread for a model narrower than :data:`SMALL_MODEL_WIDTH`, all cores for others."""
    if _PASSIVE if passive is None else passive:
        return all_cores()
    width = model_width(model)
    return 1 if width is not None and width < SMALL_MODEL_WIDTH else all_cores()


def choose_threads(model: RecurrentModel, threads: int | None = None) -> int:
    """``threads`` if given, else ``RSMEM_THREADS``, else :func:`auto_threads`."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        return threads
    return settings.threads_setting() or auto_threads(model)


def use_threads(model: RecurrentModel, threads: int | None = None) -> int:
    """Set torch's intra-op thread count for ``model``'s work (:func:`choose_threads`); returns it."""
    import torch

    global _auto_count
    all_cores()  # remember torch's default before the first change
    n = choose_threads(model, threads)
    _auto_count = threads is None and settings.threads_setting() is None
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@contextmanager
def one_thread_below(work: int, limit: int) -> Iterator[None]:
    """torch's intra-op threads set to one while the block runs when ``work < limit`` (a process-wide setting,
    restored after; cheap enough for every call): for small operations that a parallel region would hand to a
    sleeping partner thread for nothing. ``one_thread_below(0, 1)``: always."""
    with _threads_while(1 if work < limit else None):
        yield


@contextmanager
def _threads_while(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count at ``n`` while the block runs, restored after (also on errors); None or
    the count in force: nothing changes (None without asking torch: every compiled step's call passes
    through here, by :func:`unraised_threads`)."""
    if n is None:
        yield
        return
    import torch  # not at import: this module runs before torch loads

    threads = torch.get_num_threads()
    if n == threads:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def others_runnable(path: str = LOADAVG) -> int:
    """Runnable threads on the machine besides the calling one (``/proc/loadavg``'s fourth field counts the
    runnable scheduling entities, the caller among them); 0 where the file cannot be read."""
    try:
        with open(path) as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, IndexError, ValueError):
        return 0


@contextmanager
def prompt_threads(tokens_per_seq: int) -> Iterator[None]:
    """torch's intra-op threads at twice the cores while the block runs, when it is prompt work
    (``tokens_per_seq >= PROMPT_TOKENS``), another process's thread is runnable now, the count is
    :func:`use_threads`' automatic one and OpenMP's idle threads sleep (see the module: each core then
    holds two of rsmem's threads beside the neighbour). Restored after, also on errors. Compiled code
    inside the block runs at the count before it (:func:`unraised_threads`)."""
    global _raised_from
    busy = None
    if tokens_per_seq >= PROMPT_TOKENS and _auto_count and _PASSIVE and settings.busy_threads_enabled():
        import torch  # not at import: this module runs before torch loads

        if torch.get_num_threads() == all_cores() and others_runnable() > 0:
            busy = 2 * all_cores()
    if busy is None or _raised_from is not None:
        yield
        return
    _raised_from = all_cores()
    try:
        with _threads_while(busy):
            yield
    finally:
        _raised_from = None


@contextmanager
def unraised_threads() -> Iterator[None]:
    """Inside :func:`prompt_threads`' raise, torch's thread count back at the count before it while the
    block runs (elsewhere nothing changes). For compiled functions
    (:class:`rsmem.models.step.compiled.CompiledStep`): inductor writes the thread count into its kernels and
    dynamo guards every compilation on it, so a compiled prefill block (Mamba's scan, RWKV's chunk solves)
    called at a raised count compiled again each time a busy neighbour came or went, up to the recompile
    limit, and then ran eagerly."""
    with _threads_while(_raised_from):
        yield
