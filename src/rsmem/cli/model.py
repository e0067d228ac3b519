"""Model options and loading, shared by the commands that run a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rsmem.errors import RsmemError
from rsmem.startup import interrupt_exits
from rsmem.threads import use_threads

if TYPE_CHECKING:
    from rsmem.engine import LLM


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file or Hugging Face folder (default: the embedded model)")
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="torch threads, at most twice the CPUs (default: $RSMEM_THREADS, else chosen by the model: "
        "rsmem.threads)",
    )
    p.add_argument("--bf16", action="store_true", help="keep weight matrices in bfloat16")
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        metavar="N",
        help="hybrid models: KV cache cells in all, shared out among the sequences unless --kv-unified "
        "(default: sequences x 4096, or x the model's context length when smaller)",
    )
    p.add_argument(
        "--kv-unified",
        action="store_true",
        help="hybrid models: one KV cache all sequences draw on (default: an equal share each)",
    )
    p.add_argument(
        "--compile",
        choices=["auto", "1", "0"],
        default=None,
        help="decode steps through torch.compile: auto (models of 16M+ matrix weights), 1 or 0 "
        "(default: $RSMEM_COMPILE, else auto; serve: else 1)",
    )


def model_path(model: str | None) -> Path:
    """The model named on the command line, or the embedded one; it must exist."""
    from rsmem.engine import default_model_path

    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise RsmemError(f"model not found: {path}")
    return path


def ctx_size(args: argparse.Namespace) -> int | None:
    """``-c``/``--ctx-size`` as typed (None: the default), checked."""
    n = getattr(args, "ctx_size", None)
    if n is not None and n < 1:
        raise RsmemError(f"--ctx-size {n}: must be at least 1 (KV cells in all)")
    return n


def load(args: argparse.Namespace, n_seq_max: int) -> LLM:
    """The model of ``-m`` with a context of ``n_seq_max`` sequences; compiled now if it compiles. Ctrl-C
    meanwhile exits with 130 at once (:func:`rsmem.startup.interrupt_exits`)."""
    with interrupt_exits():
        return _load(args, n_seq_max)


def _load(args: argparse.Namespace, n_seq_max: int) -> LLM:
    from rsmem.engine import LLM

    path = model_path(args.model)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    llm = LLM(
        path,
        n_seq_max=n_seq_max,
        n_batch=512,
        dtype=dtype,
        compile=args.compile,
        n_rs_seq=getattr(args, "rollback_depth", 0),
        n_ctx=ctx_size(args),
        kv_unified=getattr(args, "kv_unified", False),
    )
    use_threads(llm.model, args.threads)
    if llm.tokenizer is None:
        raise RsmemError(f"{path} has no tokenizer: text generation needs one")
    warm_up = getattr(llm.model, "warm_up", None)
    if getattr(llm.model, "compile_decode", False) and callable(warm_up):  # say so, pay it now, not mid-text
        sys.stderr.write("[compiling decode steps (torch.compile; cached for later runs)...]\n")
        sys.stderr.write(f"[compiled in {warm_up():.1f} s]\n")
    return llm


def prepare_kernels(model: object) -> bool:
    """For a server: load (or build, slow but once per machine) the C++ kernels now when ``model``'s
    prompts will use them, so that no request waits for the build; whether they are loaded."""
    from rsmem.loaders.registry import ARCHS

    # prompts of 64+ tokens run C++ kernels in every family with a short convolution (csrc/conv1d.cpp):
    # all but RWKV's
    entry = ARCHS.get(str(getattr(model, "arch", None)))
    if entry is None or entry.family == "rwkv":
        return False
    from rsmem.kernels.build import native_ops

    sys.stderr.write("[loading the C++ kernels (built once per machine)...]\n")
    return native_ops() is not None
