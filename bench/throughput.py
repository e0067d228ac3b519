"""Throughput of rsmem's Mamba / Mamba-2 against transformers and llama.cpp on the same random weights.

130M-class configs (d_model 768, 24 layers), f32, ``--threads`` threads: prefill of one long prompt, then
decode steps with 1, 8 and 64 parallel sequences, in tokens/s. llama.cpp runs through llama-cpp-python in
the interpreter given by ``--llama-python`` (a separate venv; it is not a dependency of rsmem). The
"ceiling" columns are torch's own f32 matmul rate at the same row count, measured here, and the share of
it the whole model step reaches (matmul FLOPs of the step / step time / ceiling).

    python bench/throughput.py --arch both --llama-python /path/to/venv/bin/python

rsmem's decode steps run through ``torch.compile`` as they do by default for models of this size
(``rsmem.models.step.compiled``; compiled during the untimed first decode step of each kind); ``--compile 0``
benchmarks the eager path instead. The machine's memory bandwidth drifts (2x within a minute was seen), so
each row is measured ``--rounds`` times with rsmem and llama.cpp back to back (llama.cpp in a worker process
that keeps its model loaded): the tables give medians, and rsmem/llama.cpp is the median of the per-round
ratios with their range. With ``--arch both`` a last table puts the two architectures side by side.
transformers' Mamba-2 has no fast CPU path (its decode at 64 sequences takes minutes):
``--no-transformers-mamba2`` skips it, and ``--no-transformers`` skips transformers altogether.

``--contention`` measures every row twice in each round, alone and with one CPU-bound process beside both
programs (started before the row, stopped after it), and adds a table of the busy figures and of the share
of its own quiet throughput each program keeps (median of per-round busy/quiet ratios). rsmem runs with
the wait policy ``import rsmem`` sets (``rsmem.threads``; imported before torch here for that reason).
``--weights f32,q8_0,q4_k_m`` measures each 130M model also quantized, by llama.cpp's own quantizer
(``llama_model_quantize`` in the ``--llama-python`` venv), with both programs' resident memory.
``--gguf FILE`` (repeatable) measures existing files too, e.g. the embedded model; ``--skip-130m`` only them.

Other architectures come from ``bench/archs_*.py`` modules (``ARCHS``: see ``bench/bench_arch.py``): their
names are ``--arch`` values, with their own columns (the ``rwkv`` package's speed) and rows; a row
``decode1@N`` decodes one sequence after an N-token prompt (attention layers' cost grows with it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# isort: off
import rsmem  # first: it sets OpenMP's wait policy, which libgomp reads when torch loads (rsmem.threads)
import torch

# isort: on

sys.path.insert(0, str(Path(__file__).parent))  # the architecture modules beside this script
from bench_arch import BenchArch, row_shape
from llama_side import LlamaWorker, llama_quantize, rsmem_resident

DECODE_SEQS = (1, 8, 64)


def hf_config(arch: str):
    from transformers import Mamba2Config, MambaConfig

    if arch == "mamba":
        return MambaConfig(
            vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16, time_step_rank=48
        )
    return Mamba2Config(
        vocab_size=50288,  # 50280 padded to a multiple of 16, as llama.cpp pads Mamba-2 vocabularies
        hidden_size=768,
        num_hidden_layers=24,
        state_size=128,
        head_dim=64,
        num_heads=24,
        n_groups=1,
        expand=2,
        chunk_size=256,
        tie_word_embeddings=True,
    )


def write_byte_tokenizer(folder: Path, n_vocab: int) -> None:
    """A byte-level BPE vocabulary padded to ``n_vocab``: llama.cpp refuses a GGUF without a vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): i for i, c in enumerate(cs)}
    vocab["Ġt"] = len(vocab)
    spec = {
        "version": "1.0",
        "added_tokens": [{"id": n_vocab - 1, "content": "<|endoftext|>", "special": True}],
        "model": {"type": "BPE", "vocab": vocab, "merges": ["Ġ t"]},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def timed(fn, repeat: int = 1) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def matmul_ceiling(rows: int, d_model: int = 768) -> float:
    """torch's f32 GFLOP/s for ``[rows, d] @ [d, 4d]`` (an in_proj-sized product), the best of five
    timings: the machine's quiet rate, not whatever a neighbour left of it."""
    a, w = torch.randn(rows, d_model), torch.randn(4 * d_model, d_model)
    reps = max(3, 2048 // rows)
    best = min(timed(lambda: torch.nn.functional.linear(a, w), reps) for _ in range(5))
    return 2 * rows * d_model * 4 * d_model / best / 1e9


def read_bandwidth(threads: int) -> float:
    """The machine's read bandwidth now, in GB/s: the best of five sums of a 512 MiB float32 tensor."""
    big = torch.ones(128 << 20)
    best = min(timed(lambda: big.sum()) for _ in range(5))
    return big.numel() * 4 / best / 1e9


def streamed_bytes(model) -> int:
    """Bytes a one-sequence decode step reads from memory: every matrix once (the head included; the
    embedding only one row), as held (float32, or a quantized matrix's blocks), plus the small tensors:
    the tensors and QuantMatrix objects reachable from the head and the layers (hybrid layers nest their
    attention and mixer records). A tensor's bytes are the span of memory it covers, and overlapping
    spans count once: views of one matrix (LFM2's ``gate_up`` and its two halves) are read once."""
    from rsmem.models.ops.quantized import QuantMatrix, matrix_bytes

    seen: set[int] = set()
    spans: list[tuple[int, int]] = []  # [start, end) byte addresses of the tensors found
    quantized = 0

    def walk(obj: object, depth: int = 0) -> None:
        nonlocal quantized
        if obj is None or id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if isinstance(obj, QuantMatrix):
            quantized += matrix_bytes(obj)
        elif isinstance(obj, torch.Tensor):
            if obj.numel():
                extent = sum((n - 1) * abs(st) for n, st in zip(obj.shape, obj.stride(), strict=True)) + 1
                spans.append((obj.data_ptr(), obj.data_ptr() + extent * obj.element_size()))
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, depth + 1)
        else:
            names = getattr(obj, "__slots__", None) or list(getattr(obj, "__dict__", {}))
            for n in names:
                walk(getattr(obj, n, None), depth + 1)

    walk(model.lm_head)
    for layer in model.layers:
        walk(layer)
    total, reached = 0, 0
    for start, end in sorted(spans):  # the union of the spans
        start = max(start, reached)
        if end > start:
            total += end - start
            reached = end
    return total + quantized


def matmul_flops_per_token(model) -> int:
    names = ("in_proj", "x_proj", "dt_proj", "out_proj")
    n = sum(getattr(layer, k).numel() for layer in model.layers for k in names if hasattr(layer, k))
    return 2 * (n + model.lm_head.numel())


class RsmemRunner:
    """rsmem's side of each measurement, on one loaded model (compiled steps warm after the first)."""

    def __init__(
        self, path: Path, n_prompt: int, steps: int, compile_setting: str, threads: int | None
    ) -> None:
        self.model = rsmem.load_model(path, compile=compile_setting, n_threads=threads)
        self.resident = rsmem_resident(path)  # measured in a fresh process
        self.n_prompt, self.steps = n_prompt, steps
        self.prompt = [(7 * i) % min(50000, self.model.n_vocab - 1) + 1 for i in range(n_prompt)]

    def measure(self, row: str) -> float:
        """Tokens/s of one row of the table (a warm-up run or step first, untimed)."""
        model, n_prompt = self.model, self.n_prompt
        if row == "prefill":

            def prefill() -> None:
                ctx = rsmem.Context(model, n_seq_max=1, n_batch=n_prompt, n_ubatch=n_prompt)
                ctx.decode(rsmem.Batch(self.prompt, seq_ids=[[0]] * n_prompt))

            return n_prompt / timed(prefill)
        n, context = row_shape(row)
        # hybrids: one KV stream of 8192 cells, as the llama.cpp worker's (pure recurrent models ignore it)
        ctx = rsmem.Context(model, n_seq_max=n, n_ctx=8192, kv_unified=True)
        for i in range(0, context, n_prompt):
            chunk = [(7 * p) % 1000 + 1 for p in range(i, min(i + n_prompt, context))]
            ctx.decode(rsmem.Batch(chunk, seq_ids=[[0]] * len(chunk), logits=[False] * len(chunk)))
        ctx.decode(rsmem.Batch([5] * n, seq_ids=[[s] for s in range(n)], logits=[True] * n))
        k = [0]

        def step() -> None:
            k[0] += 1
            toks = [(s + k[0]) % 1000 + 1 for s in range(n)]
            ctx.decode(rsmem.Batch(toks, seq_ids=[[s] for s in range(n)], logits=[True] * n))

        return n / timed(step, self.steps)

    def close(self) -> None:
        pass


@torch.inference_mode()
def bench_transformers(hf_model, n_prompt: int, steps: int) -> dict[str, float]:
    res = {}
    ids = torch.tensor([[(7 * i) % 50000 + 1 for i in range(n_prompt)]])
    res["prefill"] = n_prompt / timed(lambda: hf_model(ids, use_cache=False))
    for n in DECODE_SEQS:
        start = torch.full((n, 1), 5)

        def gen(start=start) -> None:
            hf_model.generate(start, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)

        res[f"decode{n}"] = n * steps / timed(gen)  # includes one prompt token per sequence
    return res


ROWS = ("prefill", *(f"decode{n}" for n in DECODE_SEQS))
EXTRA_ARCHS: dict[str, BenchArch] = {}  # filled by main() from bench/archs_*.py


@dataclass
class ArchResult:
    """One architecture's table: median tokens/s per column and row, and rsmem / llama.cpp as the median
    of the per-round ratios (each round measures the two back to back) with its spread."""

    cols: dict[str, dict[str, float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    compiled: bool = False
    flops_per_token: int = 0
    streamed: int = 0  # bytes a one-sequence decode step reads
    rows: list[str] = field(default_factory=list)  # the rows measured (``--rows`` plus the arch's own)
    resident: dict[str, int] = field(default_factory=dict)  # program -> resident bytes the model took
    file_bytes: int = 0
    busy: ArchResult | None = None  # --contention: the same rows beside one CPU-bound process
    kept: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # name -> row -> busy/quiet

    def ratio(self, row: str) -> float:
        r = self.ratios.get(row)
        return statistics.median(r) if r else float("nan")

    def spread(self, row: str) -> str:
        r = self.ratios.get(row)
        return f"{min(r):.2f}-{max(r):.2f}" if r else ""


def bench_arch(arch: str, args: argparse.Namespace) -> dict[str, ArchResult]:
    """Build the random model, convert it, then measure every row ``args.rounds`` times, rsmem and
    llama.cpp back to back each time (this machine's memory bandwidth drifts by 2x within a minute); one
    result per ``--weights`` type (``"f32"``, or a file llama.cpp's quantizer made from the f32 one)."""
    if arch in EXTRA_ARCHS:
        return {"f32": bench_extra_arch(EXTRA_ARCHS[arch], args)}
    from transformers import Mamba2ForCausalLM, MambaForCausalLM

    skip_hf = args.no_transformers or (arch == "mamba2" and args.no_transformers_mamba2)
    result = ArchResult()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        torch.manual_seed(0)
        cls = MambaForCausalLM if arch == "mamba" else Mamba2ForCausalLM
        hf_model = cls(hf_config(arch)).eval()
        hf_model.save_pretrained(folder)
        write_byte_tokenizer(folder, hf_model.config.vocab_size)
        gguf_path = rsmem.convert(folder, Path(tmp) / "model-f32.gguf", "f32")
        if not skip_hf and "f32" in args.weights:
            result.cols["transformers"] = bench_transformers(hf_model, args.prompt, max(4, args.steps // 2))
        del hf_model
        results = {}
        for weights in args.weights:
            path = gguf_path
            if weights != "f32":
                path = quantized_file(gguf_path, Path(tmp) / f"model-{weights}.gguf", weights, args)
            results[weights] = measure_file(path, args, result if weights == "f32" else ArchResult())
        return results


def quantized_file(src: Path, dst: Path, ftype: str, args: argparse.Namespace) -> Path:
    """``src`` quantized to ``ftype`` by llama.cpp's quantizer (``--llama-python``), else by rsmem's."""
    if args.llama_python:
        return llama_quantize(args.llama_python, src, dst, ftype)
    from rsmem.loaders.quantize import quantize_gguf

    return quantize_gguf(src, dst, ftype)


def bench_extra_arch(spec: BenchArch, args: argparse.Namespace) -> ArchResult:
    """An architecture of a ``bench/archs_*.py`` module: its GGUF, its own columns, then rsmem and
    llama.cpp on every row (the ``--rows`` and the architecture's extra ones)."""
    result = ArchResult(rows=list(dict.fromkeys([*args.rows, *spec.rows])))  # a row asked for twice runs once
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = spec.build(Path(tmp))
        if spec.columns is not None:
            result.cols.update(spec.columns(gguf_path, args))
        return measure_file(gguf_path, args, result)


def load_extra_archs() -> dict[str, BenchArch]:
    """``ARCHS`` of every ``bench/archs_*.py`` module (RWKV, hybrids): their keys are ``--arch`` values."""
    archs: dict[str, BenchArch] = {}
    for path in sorted(Path(__file__).with_name("bench_arch.py").parent.glob("archs_*.py")):
        archs.update(importlib.import_module(path.stem).ARCHS)
    return archs


# --llama-policy: llama.cpp's workers (name, OMP_WAIT_POLICY=PASSIVE?). With "both", each round's faster one
# is the "llama.cpp" column that rsmem is compared with: spinning threads win on a quiet machine and
# collapse beside a busy process, sleeping ones the other way round (README, "Threads under contention")
LLAMA_POLICIES = {
    "both": (("llama.cpp default", False), ("llama.cpp passive", True)),
    "default": (("llama.cpp", False),),
    "passive": (("llama.cpp", True),),
}


def measure_file(gguf_path: Path, args: argparse.Namespace, result: ArchResult) -> ArchResult:
    """Measure every row ``args.rounds`` times on one GGUF file, rsmem and llama.cpp back to back (and,
    with ``--contention``, each again beside a busy process)."""
    runners: dict[str, RsmemRunner | LlamaWorker] = {
        "rsmem": RsmemRunner(gguf_path, args.prompt, args.steps, args.compile, args.rsmem_threads)
    }
    for name, passive in LLAMA_POLICIES[args.llama_policy] if args.llama_python else ():
        try:
            runners[name] = LlamaWorker(
                args.llama_python, gguf_path, args.prompt, args.steps, args.threads, passive
            )
        except (OSError, RuntimeError) as exc:
            print(f"{name} worker failed: {exc}")
    llamas = [name for name in runners if name.startswith("llama.cpp")]
    modes = {"quiet": result} | ({"busy": ArchResult()} if args.contention else {})
    result.busy = modes.get("busy")
    result.rows = result.rows or list(args.rows)
    names = [*runners, *(["llama.cpp"] if len(llamas) > 1 else [])]
    samples = {m: {name: {row: [] for row in result.rows} for name in names} for m in modes}
    for _ in range(args.rounds):
        for row in result.rows:
            got: dict[str, dict[str, float]] = {}
            for mode, res in modes.items():
                with busy_neighbour(mode == "busy"):
                    got[mode] = {name: runner.measure(row) for name, runner in runners.items()}
                if len(llamas) > 1:  # the faster policy of this round: rsmem is compared with that one
                    got[mode]["llama.cpp"] = max(got[mode][name] for name in llamas)
                for name, value in got[mode].items():
                    samples[mode][name][row].append(value)
                if "llama.cpp" in got[mode]:
                    res.ratios.setdefault(row, []).append(got[mode]["rsmem"] / got[mode]["llama.cpp"])
            if "busy" in got:
                for name in names:
                    share = got["busy"][name] / got["quiet"][name]
                    result.kept.setdefault(name, {}).setdefault(row, []).append(share)
    result.resident = {name: runner.resident for name, runner in runners.items()}
    result.file_bytes = gguf_path.stat().st_size
    for runner in runners.values():
        runner.close()
    for mode, res in modes.items():
        for name, rows in samples[mode].items():
            res.cols[name] = {row: statistics.median(v) for row, v in rows.items() if v}
    model = runners["rsmem"].model  # type: ignore[union-attr]
    result.compiled = model.compile_decode
    result.flops_per_token = matmul_flops_per_token(model)
    result.streamed = streamed_bytes(model)
    return result


@contextlib.contextmanager
def busy_neighbour(on: bool) -> Iterator[None]:
    """One CPU-bound process (a pure-Python loop: one core's worth of demand) while the block runs."""
    if not on:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.2)  # running, not starting
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def print_contention(arch: str, res: ArchResult, args: argparse.Namespace) -> None:
    """The busy figures and the share of its quiet throughput each program keeps beside the busy process."""
    busy = res.busy
    assert busy is not None
    names = [n for n in ("rsmem", "llama.cpp") if n in busy.cols]
    names += [n for n in busy.cols if n.startswith("llama.cpp ")]  # each policy of --llama-policy both
    print(f"\n{arch} beside one CPU-bound process: tokens/s, and busy/quiet (median of per-round ratios)")
    head = "".join(f"{n:>18}{'kept':>8}" for n in names)
    print(f"{'':12}{head}{'rsmem/llama':>13}{'kept ratio':>12}")
    for row in res.rows:
        line, kept = f"{row:12}", {}
        for n in names:
            kept[n] = statistics.median(res.kept[n][row])
            line += f"{busy.cols[n].get(row, float('nan')):18.1f}{kept[n]:8.0%}"
        line += f"{busy.ratio(row):13.2f}"
        line += f"{kept['rsmem'] / kept['llama.cpp']:12.2f}" if "llama.cpp" in kept else ""
        print(line, flush=True)


def print_arch(
    arch: str, res: ArchResult, args: argparse.Namespace, ceilings: dict[int, float], weights: str = "f32"
) -> None:
    compiled = "rsmem decode compiled" if res.compiled else "rsmem decode eager"
    title = arch if arch.endswith(".gguf") else f"{arch} 130M, {weights}"
    print(f"\n{title}, {args.threads} threads, {compiled}, median of {args.rounds} rounds: tokens/s")
    known = ("rsmem", "transformers", "llama.cpp")
    names = [n for n in known if n in res.cols] + [n for n in res.cols if n not in known]  # + an arch's own
    width = {c: max(14, len(c) + 2) for c in names}
    header = "".join(f"{c:>{width[c]}}" for c in names)
    print(f"{'':12}{header}{'rsmem/llama':>13}{'(range)':>12}{'of ceiling':>12}")
    for row in res.rows:
        line = f"{row:12}" + "".join(f"{res.cols[c].get(row, float('nan')):{width[c]}.1f}" for c in names)
        rows = args.prompt if row == "prefill" else row_shape(row)[0]
        gflops = res.cols["rsmem"][row] * res.flops_per_token / 1e9
        ceiling = f"{gflops / ceilings[rows]:12.0%}" if rows in ceilings else ""
        line += f"{res.ratio(row):13.2f}{res.spread(row):>12}{ceiling}"
        print(line, flush=True)
    if res.streamed and "decode1" in res.cols.get("rsmem", {}):
        bound = args.bandwidth * 1e9 / res.streamed
        reached = res.cols["rsmem"]["decode1"] / bound
        print(
            f"decode1 reads {res.streamed / 1e6:.0f} MB a token: at the {args.bandwidth:.1f} GB/s read here "
            f"that bounds it to {bound:.0f} tokens/s; rsmem reached {reached:.0%}"
        )
    memory = ", ".join(f"{name} {b / 1e6:.0f} MB" for name, b in res.resident.items())
    print(f"resident memory the model took: {memory}; file {res.file_bytes / 1e6:.0f} MB")
    if res.busy is not None:
        print_contention(arch, res, args)


def print_side_by_side(results: dict[str, ArchResult], args: argparse.Namespace) -> None:
    """One table: for each architecture rsmem, transformers, llama.cpp and rsmem / llama.cpp."""
    names, widths = ("rsmem", "transformers", "llama.cpp"), (9, 14, 11, 13)
    block = sum(widths)
    print(f"\nboth architectures, 130M, f32, {args.threads} threads, prompt {args.prompt}: tokens/s")
    print(f"{'':12}" + "".join(f"{arch:>{block}}" for arch in results))
    print(f"{'':12}" + "".join(f"{n:>{w}}" for n, w in zip((*names, "rsmem/llama"), widths)) * len(results))
    for row in args.rows:
        line = f"{row:12}"
        for res in results.values():
            line += "".join(
                f"{res.cols.get(n, {}).get(row, float('nan')):{w}.1f}" for n, w in zip(names, widths)
            )
            line += f"{res.ratio(row):{widths[-1]}.2f}"
        print(line)


def main() -> None:
    EXTRA_ARCHS.update(load_extra_archs())
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["mamba", "mamba2", "both", *EXTRA_ARCHS], default="both")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of both programs (default: rsmem's automatic count, all cores, and as many for "
        "llama.cpp; a count given here is rsmem's n_threads, which keeps prompts off "
        "rsmem.threads.prompt_threads' extra threads beside a busy process)",
    )
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per sequence count")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each row; medians are reported")
    ap.add_argument(
        "--rows", nargs="+", default=list(ROWS), help="rows to measure: prefill, decodeN, decode1@CONTEXT"
    )
    ap.add_argument("--llama-python", default=None, help="python with llama-cpp-python==0.3.36 installed")
    ap.add_argument(
        "--llama-policy",
        choices=list(LLAMA_POLICIES),
        default="both",
        help="llama.cpp's OpenMP wait policy: the environment's (default: spin, then sleep), passive (as "
        "rsmem's), or both, each round comparing rsmem with the faster of the two (default)",
    )
    ap.add_argument("--compile", choices=["auto", "1", "0"], default="auto", help="rsmem's decode compile")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-transformers-mamba2", action="store_true", help="skip transformers' (slow) Mamba-2")
    ap.add_argument("--contention", action="store_true", help="each row also beside one CPU-bound process")
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        help="also measure this GGUF file (repeatable; e.g. the embedded model: "
        "python -c 'import rsmem.engine as e; print(e.default_model_path())')",
    )
    ap.add_argument("--skip-130m", action="store_true", help="only the --gguf files")
    ap.add_argument(
        "--weights",
        type=lambda v: v.split(","),
        default=["f32"],
        help="comma-separated: f32 and llama.cpp ftypes (q8_0, q4_0, q4_k_m, q5_k_m, q6_k): each 130M model "
        "also quantized by llama.cpp's quantizer (rsmem's without --llama-python), measured the same way",
    )
    args = ap.parse_args()
    args.rsmem_threads = args.threads  # None: rsmem chooses (rsmem.threads.use_threads)
    args.threads = args.threads or rsmem.threads.all_cores()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ceilings = {n: matmul_ceiling(n) for n in (*DECODE_SEQS, args.prompt)}
    print("torch f32 matmul ceiling (GFLOP/s):", {k: round(v, 1) for k, v in ceilings.items()})
    args.bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth (sum of 512 MiB, best of 5): {args.bandwidth:.1f} GB/s")
    print(f"rsmem's OpenMP wait policy: {rsmem.threads.wait_policy()}", end="; ")
    print(f"llama.cpp's: {args.llama_policy} (--llama-policy)")
    archs = [] if args.skip_130m else ["mamba", "mamba2"] if args.arch == "both" else [args.arch]
    results = {}
    for arch in archs:
        by_weights = bench_arch(arch, args)
        for weights, res in by_weights.items():
            print_arch(arch, res, args, ceilings, weights)
        if "f32" in by_weights:
            results[arch] = by_weights["f32"]
    if len(results) > 1:
        print_side_by_side(results, args)
    for path in map(Path, args.gguf):  # the ceiling column is for d_model 768 products: left out here
        print_arch(path.name, measure_file(path, args, ArchResult()), args, {})
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
