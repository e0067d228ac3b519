"""``rsmem quantize IN OUT --type T``: write a GGUF file's tensors in another type, as llama.cpp's
``llama-quantize`` does (``rsmem.loaders.quantize``), and print per tensor type the count and bytes of
both files and their sizes."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import gguf

from rsmem.cli.inputs import check_input_file, check_output_path
from rsmem.errors import RsmemError
from rsmem.loaders.quantize import quantize_gguf, quantize_types


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    types = quantize_types()
    q = sub.add_parser(
        "quantize",
        help="write a GGUF file with its tensors quantized (llama.cpp's types and type mix)",
        description="Quantize a GGUF file as llama.cpp's llama-quantize does: the same tensor types, and "
        "for an f32 input the same bytes. A quantized input is dequantized first (llama.cpp's "
        "--allow-requantize).",
    )
    q.add_argument("input", help="the GGUF file to quantize")
    q.add_argument("output", help="the GGUF file to write")
    q.add_argument(
        "--type",
        dest="qtype",
        type=str.lower,
        choices=types,
        required=True,
        metavar="T",
        help=f"the file type: {', '.join(types)}",
    )
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    check_input_file("the input", args.input)
    check_output_path("the output", args.output)
    if Path(args.input).resolve() == Path(args.output).resolve():
        raise RsmemError(f"the output {args.output}: is the input file")
    t0 = time.perf_counter()
    sys.stderr.write(f"quantizing {args.input} -> {args.output} ({args.qtype})...\n")
    quantize_gguf(args.input, args.output, args.qtype)  # checks the input file: before reading it here
    before, after = _summary(args.input), _summary(args.output)
    for title, summary in (("input", before), ("output", after)):
        print(f"{title} tensor types:")
        for type_name, (count, nbytes) in summary.items():
            print(f"  {type_name:<6} {count:>4} tensor{'s' if count != 1 else ' '} {nbytes / 1e6:10.3f} MB")
    size_in, size_out = Path(args.input).stat().st_size, Path(args.output).stat().st_size
    print(
        f"file size: {size_in / 1e6:.3f} MB -> {size_out / 1e6:.3f} MB "
        f"({size_out / size_in:.1%}) in {time.perf_counter() - t0:.1f}s"
    )
    return 0


def _summary(path: str) -> dict[str, tuple[int, int]]:
    """Per tensor type (most bytes first): the number of tensors and their bytes in the file."""
    return _count(gguf.GGUFReader(path).tensors)


def _count(tensors: Iterable[gguf.ReaderTensor]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for t in tensors:
        n, b = out.get(t.tensor_type.name, (0, 0))
        out[t.tensor_type.name] = (n + 1, b + int(t.n_bytes))
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))
