"""``rsmem info``, ``convert``, ``bench`` and ``demo``: the commands that do not generate text."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import torch

from rsmem import malloc
from rsmem.cli.inputs import check_output_path
from rsmem.cli.model import model_path
from rsmem.cli.run import Progress
from rsmem.errors import RsmemError
from rsmem.loaders.quantize import convert_then_quantize, quantize_types
from rsmem.loaders.registry import archs_of
from rsmem.loaders.tensor_types import Holding
from rsmem.models.ops.quantized import QuantMatrix

MALLOC_WORDS = {
    "kept": "freed blocks kept for reuse (thresholds fixed)",
    "user": "as the environment tunes it",
    "off": "glibc's defaults",
    "unavailable": "not glibc's: left alone",
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    info = sub.add_parser("info", help="architecture, sizes and state bytes of a model")
    info.add_argument("model", nargs="?", help="GGUF file or HF folder (default: the embedded model)")
    info.set_defaults(func=cmd_info)

    conv = sub.add_parser(
        "convert", help="convert a Hugging Face model folder or a BlinkDL RWKV-6/7 .pth checkpoint to GGUF"
    )
    conv.add_argument("hf_dir", metavar="source", help="a Hugging Face model folder or an RWKV .pth file")
    conv.add_argument("out")
    conv.add_argument("--outtype", type=str.lower, choices=quantize_types(), default="f16")
    conv.add_argument(
        "--vocab",
        metavar="FILE",
        help=".pth only: the RWKV World vocabulary (rwkv_vocab_v20230424.txt) to store as the tokenizer "
        "(without it the GGUF has none, and cannot generate text)",
    )
    conv.set_defaults(func=cmd_convert)

    bench = sub.add_parser("bench", help="tokens per second: default model and 130M configs")
    bench.add_argument("-m", "--model", help="model to measure (default: the embedded model)")
    bench.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="torch threads, at most twice the CPUs (default: chosen per model: rsmem.threads)",
    )
    bench.add_argument("--prompt-tokens", type=int, default=512)
    bench.add_argument("--parallel", type=int, nargs="+", default=[1, 8])
    bench.add_argument("--steps", type=int, default=16)
    bench.add_argument("--skip-130m", action="store_true", help="only the default (or -m) model")
    bench.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", help="walk through the recurrent memory on a toy model")
    demo.add_argument("--parallel", type=int, default=4, help="number of sequences (default 4)")
    demo.set_defaults(func=cmd_demo)


def cmd_info(args: argparse.Namespace) -> int:
    from rsmem import threads
    from rsmem.engine import load_text_model
    from rsmem.models.mamba.base import MambaFamilyModel

    path = model_path(args.model)
    model, tokenizer = load_text_model(path)
    hybrid = isinstance(getattr(model, "kv_layers", None), Mapping)
    rwkv = getattr(model, "arch", None) in archs_of("rwkv")
    if not hybrid and not rwkv and not isinstance(model, MambaFamilyModel):
        raise RsmemError(
            f"{path}: info describes Mamba-family, RWKV and hybrid models, not {type(model).__name__}"
        )
    cfg = getattr(model, "config", None)
    n_params = _count_parameters([getattr(model, name) for name in WEIGHTS if hasattr(model, name)])
    n_attn = sum(1 for il in range(model.n_layer) if not model.is_recurrent_layer(il))
    state = 4 * (model.n_embd_r + model.n_embd_s) * (model.n_layer - n_attn)
    print(
        f"file:            {path} ({path.stat().st_size / 1e6:.1f} MB)"
        if path.is_file()
        else f"folder: {path}"
    )
    print(f"architecture:    {model.arch}")
    for key in (
        "d_model",
        "n_layer",
        "n_vocab",
        "d_inner",
        "d_state",
        "d_conv",
        "dt_rank",
        "n_head",
        "n_group",
        "head_size",
        "d_ff",
        "n_ctx_train",
    ):
        if isinstance(getattr(cfg, key, None), int):  # per-layer tuples (Nemotron-H's d_ff) are left out
            print(f"{key + ':':<16} {getattr(cfg, key)}")
    print(f"parameters:      {n_params / 1e6:.2f} M")
    in_blocks = _print_tensor_types(path)
    print(f"state per layer: r {model.n_embd_r} + s {model.n_embd_s} floats")
    if rwkv and cfg is not None:  # llama.cpp's layout: the two token-shift rows, then the heads' WKV states
        h, n = cfg.n_head, cfg.head_size
        s_layout = "[H, K, V]" if model.arch in ("rwkv6", "rwkv6qwen2") else "[H, V, K]"
        shifts = model.n_embd_r // cfg.d_model  # 1 in ARWKV-7 and QRWKV-6 (no channel mix)
        print(f"{'':<16} r: token shift {shifts} x {cfg.d_model}; s: WKV {s_layout} = {h} x {n} x {n}")
    print(f"state per seq:   {state} bytes ({state / 1024:.1f} KiB, f32)")
    if hybrid:
        _print_kv(model)
    how = "torch.compile" if getattr(model, "compile_decode", False) else "eager"
    print(f"decode steps:    {how} (RSMEM_COMPILE / --compile of generate, chat, serve)")
    print(
        f"threads:         {threads.choose_threads(model)} (RSMEM_THREADS / -t, else by the model), "
        f"OpenMP wait policy: {threads.wait_policy()}"
    )
    print(f"products:        {_products(in_blocks)}")
    print(f"malloc:          {MALLOC_WORDS[malloc.policy() or 'off']} (RSMEM_MALLOC; rsmem.malloc)")
    if tokenizer is not None:
        print(
            f"tokenizer:       {tokenizer.tokenizer.get_vocab_size()} tokens, bos {tokenizer.bos_token_id}, "
            f"eos {tokenizer.eos_token_id}"
        )
    return 0


IN_BLOCKS = (Holding.KEPT, Holding.KEPT_2BYTES, Holding.REQUANTIZED)  # multiplied by the C++ kernels
KERNELS_NOTE = " (rsmem's kernels)"  # how such a holding ends; said only where the kernels load
# the attributes holding a model's weights (those it has): embedding, RWKV's embedding norm, layers, head
WEIGHTS = ("embedding", "emb_norm", "emb_norm_b", "norm_f", "norm_f_b", "lm_head", "layers")


def _count_parameters(objects: Sequence[object]) -> int:
    """Values in the tensors and quantized matrices reachable from ``objects`` (lists and slotted layer
    objects), each storage once (a tied head is not counted twice)."""
    seen: set[int] = set()
    total = 0
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if isinstance(obj, QuantMatrix):  # its values, not its bytes
            if obj.blocks.data_ptr() not in seen:
                seen.add(obj.blocks.data_ptr())
                total += obj.numel()
        elif isinstance(obj, torch.Tensor):
            if obj.data_ptr() not in seen:
                seen.add(obj.data_ptr())
                total += obj.numel()
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
        elif hasattr(obj, "__slots__") or hasattr(obj, "__dict__"):
            names = getattr(obj, "__slots__", ()) or vars(obj)
            stack.extend(getattr(obj, name, None) for name in names)
    return total


def _print_kv(model: object) -> None:
    """A hybrid model's attention layers and their KV cache: bytes per token, and at 4096 tokens."""
    from rsmem.memory.hybrid import HybridLayout, HybridMemory

    memory = HybridMemory.for_model(cast(HybridLayout, model), 1, n_ctx=256)
    per_token = memory.kv_bytes_per_token()
    layers = sorted(memory.kv.layer_dims)
    names = ", ".join(map(str, layers))
    print(f"attention:       {len(layers)} layer{'s' * (len(layers) != 1)} ({names}) with a KV cache")
    print(f"KV per token:    {per_token} bytes (K and V, f32; -c N cells in all, N/sequences each)")
    print(f"KV at 4096:      {per_token * 4096 / 2**20:.1f} MiB per sequence (the default context)")


def _print_tensor_types(path: Path) -> bool:
    """Per tensor type of a GGUF file: how many, their bytes in the file and how rsmem holds them; whether
    some are held in blocks. Those blocks' products load the C++ kernels (the model's first product
    would): whether they run there or in torch's reference is then known, and said."""
    from rsmem.kernels.build import native_ops
    from rsmem.loaders import is_gguf
    from rsmem.loaders.tensor_types import file_summary

    if not path.is_file() or not is_gguf(path):
        return False
    summary = file_summary(path)
    in_blocks = any(s.holding in IN_BLOCKS for s in summary)
    kernels = in_blocks and native_ops() is not None
    for i, s in enumerate(summary):
        held = s.holding.value if s.holding is not None else "not loadable"
        if not kernels:
            held = held.removesuffix(KERNELS_NOTE)
        print(
            f"{'tensor types:' if i == 0 else '':<16} {s.type_name:<7} {s.tensors:>3} tensor"
            f"{'s' if s.tensors != 1 else ' '} {s.file_bytes / 1e6:9.2f} MB in file -> {held} "
            f"({s.held_bytes / 1e6:.2f} MB)"
        )
    held_bytes, file_bytes = sum(s.held_bytes for s in summary), sum(s.file_bytes for s in summary)
    print(
        f"weights held:    {held_bytes / 1e6:.2f} MB, {held_bytes / max(file_bytes, 1):.2f}x the file's "
        f"{file_bytes / 1e6:.2f} MB of tensors"
    )
    return in_blocks


def _products(in_blocks: bool) -> str:
    """How decode products run (:func:`rsmem.threads.product_workers`); for matrices held in blocks
    without the C++ kernels: torch's reference, and why the kernels are missing."""
    from rsmem import settings, threads
    from rsmem.kernels.build import build_error, loaded_native_ops

    if not in_blocks or loaded_native_ops() is not None:
        return threads.product_workers()
    why = (
        "are off: RSMEM_KERNELS=0" if not settings.kernels_setting()[0] else f"did not build: {build_error()}"
    )
    return f"torch's, from the blocks a tile at a time (the C++ kernels {why})"


def cmd_convert(args: argparse.Namespace) -> int:
    from rsmem.loaders import convert_blink_to_gguf, convert_hf_to_gguf
    from rsmem.loaders.rwkv.convert import is_blink_checkpoint

    src = Path(args.hf_dir)
    vocab = getattr(args, "vocab", None)
    blink = is_blink_checkpoint(src)
    if not blink and not (src / "config.json").is_file():
        raise RsmemError(
            f"{src} is not a Hugging Face model folder (no config.json) nor an RWKV .pth checkpoint"
        )
    if vocab is not None and not blink:
        raise RsmemError(f"--vocab {vocab}: only for RWKV .pth checkpoints (a folder carries its tokenizer)")
    if vocab is not None and not Path(vocab).is_file():
        raise RsmemError(f"--vocab {vocab}: no such file")
    check_output_path("the output", args.out)
    t0 = time.perf_counter()
    sys.stderr.write(f"converting {src} -> {args.out} ({args.outtype})...\n")
    if blink:
        if vocab is None:
            sys.stderr.write("no --vocab: the GGUF will have no tokenizer\n")
        if args.outtype in ("f32", "f16", "bf16", "q8_0"):
            convert_blink_to_gguf(src, args.out, outtype=args.outtype, vocab=vocab)
        else:  # the other types: an f32 file quantized by rsmem quantize's rules
            convert_then_quantize(
                lambda tmp: convert_blink_to_gguf(src, tmp, outtype="f32", vocab=vocab),
                args.out,
                args.outtype,
            )
    else:
        convert_hf_to_gguf(src, args.out, outtype=args.outtype)
    size = Path(args.out).stat().st_size
    sys.stderr.write(f"wrote {args.out}: {size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f}s\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rsmem.benchmark import format_table, measure
    from rsmem.engine import load_text_model
    from rsmem.models.mamba.random_init import mamba2_130m, mamba_130m
    from rsmem.threads import use_threads, wait_policy

    progress = Progress(enabled=True)
    parallel = tuple(args.parallel)
    results = []
    path = model_path(args.model)
    model, _ = load_text_model(path)
    name = f"{'default model' if not args.model else path.name}, t{use_threads(model, args.threads)}"
    results.append(
        measure(
            model,
            name,
            n_prompt=args.prompt_tokens,
            parallel=parallel,
            steps=args.steps,
            progress=progress.update,
        )
    )
    if not args.skip_130m:
        for label, build in (("mamba 130M (random)", mamba_130m), ("mamba2 130M (random)", mamba2_130m)):
            progress.update(f"building {label}")
            big = build()
            results.append(
                measure(
                    big,
                    f"{label}, t{use_threads(big, args.threads)}",
                    n_prompt=args.prompt_tokens,
                    parallel=parallel,
                    steps=args.steps,
                    progress=progress.update,
                )
            )
    progress.done()
    print(f"f32; tN: N threads; OpenMP wait policy: {wait_policy()}")
    print(format_table(results))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Walk through the recurrent memory: parallel decode, fork, save and restore, on the toy model."""
    import tempfile

    from rsmem import Batch, Context
    from rsmem.models import DecayedSumModel

    model = DecayedSumModel(n_vocab=64, n_embd=8, n_layer=4)
    ctx = Context(model, n_seq_max=args.parallel)
    prompts: dict[int, Sequence[int]] = {
        s: [(7 * s + k) % 64 for k in range(3 + s)] for s in range(args.parallel)
    }
    ctx.decode(Batch.from_sequences(prompts))
    print(f"decoded {sum(map(len, prompts.values()))} prompt tokens of {len(prompts)} sequences in one batch")
    mem = ctx.memory
    print(
        f"memory: {mem.used} cells used of {mem.size}, {mem.state_bytes_per_seq()} state bytes per sequence"
    )
    if args.parallel > 1:
        mem.seq_rm(args.parallel - 1, -1, -1)
        mem.seq_cp(0, args.parallel - 1)
        print(f"forked sequence 0 into {args.parallel - 1} (shared cell, no copy): {mem.used} cells used")
    ctx.decode(Batch.from_sequences({s: [s % 64] for s in range(args.parallel)}))
    print(f"decoded one step of {args.parallel} sequences: {mem.used} cells used")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seq0.ggsq"
        size = ctx.state_seq_save_file(path, 0, list(prompts[0]))
        tokens = ctx.state_seq_load_file(path, 0)
        print(f"saved sequence 0 to a llama.cpp-format file ({size} bytes), restored {len(tokens)} tokens")
    return 0
