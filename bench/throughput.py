"""Throughput of rsmem's Mamba / Mamba-2 against transformers and llama.cpp on the same random weights.

130M-class configs (d_model 768, 24 layers), f32, ``--threads`` threads: prefill of one long prompt, then
decode steps with 1, 8 and 64 parallel sequences, in tokens/s. llama.cpp runs through llama-cpp-python in
the interpreter given by ``--llama-python`` (a separate venv; it is not a dependency of rsmem). The
"ceiling" columns are torch's own f32 matmul rate at the same row count, measured here, and the share of
it the whole model step reaches (matmul FLOPs of the step / step time / ceiling).

    python bench/throughput.py --arch both --llama-python /path/to/venv/bin/python

rsmem's decode steps run through ``torch.compile`` as they do by default for models of this size
(``rsmem.models.compiled``; compiled during the untimed first decode step of each kind); ``--compile 0``
benchmarks the eager path instead. With ``--arch both`` a last
table puts the two architectures side by side. transformers' Mamba-2 has no fast
CPU path (its decode at 64 sequences takes minutes): ``--no-transformers-mamba2`` skips it, and
``--no-transformers`` skips transformers altogether.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import rsmem

DECODE_SEQS = (1, 8, 64)

LLAMA_SCRIPT = r"""
import json, sys, time
import llama_cpp as L
path, n_prompt, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 8192, max(n_prompt, 64), max(n_prompt, 64), 64
cp.n_threads = cp.n_threads_batch = threads
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
batch = L.llama_batch_init(max(n_prompt, 64), 0, 1)
def decode(entries):
    batch.n_tokens = len(entries)
    for i, (t, p, s, out) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, out
        batch.seq_id[i][0] = s
    assert L.llama_decode(ctx, batch) == 0
res = {}
prompt = [(7 * i) % 50000 + 1 for i in range(n_prompt)]
t0 = time.perf_counter(); decode([(t, i, 0, i == n_prompt - 1) for i, t in enumerate(prompt)])
res["prefill"] = n_prompt / (time.perf_counter() - t0)
for n in (1, 8, 64):
    L.llama_memory_clear(mem, True)
    decode([(5, 0, s, True) for s in range(n)])
    t0 = time.perf_counter()
    for k in range(1, steps + 1):
        decode([((s + k) % 1000 + 1, k, s, True) for s in range(n)])
    res[f"decode{n}"] = n * steps / (time.perf_counter() - t0)
print(json.dumps(res))
"""


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
    """torch's f32 GFLOP/s for ``[rows, d] @ [d, 4d]`` (an in_proj-sized product)."""
    a, w = torch.randn(rows, d_model), torch.randn(4 * d_model, d_model)
    reps = max(3, 2048 // rows)
    return 2 * rows * d_model * 4 * d_model / timed(lambda: torch.nn.functional.linear(a, w), reps) / 1e9


def matmul_flops_per_token(model) -> int:
    names = ("in_proj", "x_proj", "dt_proj", "out_proj")
    n = sum(getattr(layer, k).numel() for layer in model.layers for k in names if hasattr(layer, k))
    return 2 * (n + model.lm_head.numel())


def bench_rsmem(
    path: Path, n_prompt: int, steps: int, compile_setting: str
) -> tuple[dict[str, float], dict[str, float]]:
    model = rsmem.load_model(path, compile=compile_setting)
    res, step_s = {}, {}
    prompt = [(7 * i) % 50000 + 1 for i in range(n_prompt)]

    def prefill() -> None:
        ctx = rsmem.Context(model, n_seq_max=1, n_batch=n_prompt, n_ubatch=n_prompt)
        ctx.decode(rsmem.Batch(prompt, seq_ids=[[0]] * n_prompt))

    res["prefill"] = n_prompt / timed(prefill)
    for n in DECODE_SEQS:
        ctx = rsmem.Context(model, n_seq_max=n)
        ctx.decode(rsmem.Batch([5] * n, seq_ids=[[s] for s in range(n)], logits=[True] * n))
        k = [0]

        def step(ctx=ctx, n=n, k=k) -> None:
            k[0] += 1
            toks = [(s + k[0]) % 1000 + 1 for s in range(n)]
            ctx.decode(rsmem.Batch(toks, seq_ids=[[s] for s in range(n)], logits=[True] * n))

        dt = timed(step, steps)
        res[f"decode{n}"] = n / dt
        step_s[f"decode{n}"] = dt
    step_s["flops_per_token"] = matmul_flops_per_token(model)
    step_s["compiled"] = float(model.compile_decode)
    return res, step_s


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


def bench_llamacpp(python: str, path: Path, n_prompt: int, steps: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [python, "-c", LLAMA_SCRIPT, str(path), str(n_prompt), str(steps), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


ROWS = ("prefill", *(f"decode{n}" for n in DECODE_SEQS))


def bench_arch(arch: str, args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Columns ``rsmem``, ``transformers``, ``llama.cpp`` (those that ran) of tokens/s by row, and rsmem's
    step times."""
    from transformers import Mamba2ForCausalLM, MambaForCausalLM

    skip_hf = args.no_transformers or (arch == "mamba2" and args.no_transformers_mamba2)
    cols: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        torch.manual_seed(0)
        cls = MambaForCausalLM if arch == "mamba" else Mamba2ForCausalLM
        hf_model = cls(hf_config(arch)).eval()
        hf_model.save_pretrained(folder)
        write_byte_tokenizer(folder, hf_model.config.vocab_size)
        gguf_path = rsmem.convert(folder, Path(tmp) / "model-f32.gguf", "f32")
        cols["rsmem"], step_s = bench_rsmem(gguf_path, args.prompt, args.steps, args.compile)
        if not skip_hf:
            cols["transformers"] = bench_transformers(hf_model, args.prompt, max(4, args.steps // 2))
        del hf_model
        if args.llama_python:
            try:
                cols["llama.cpp"] = bench_llamacpp(
                    args.llama_python, gguf_path, args.prompt, args.steps, args.threads
                )
            except (subprocess.CalledProcessError, ValueError) as exc:
                print(f"llama.cpp run failed: {exc}")
    return cols, step_s


def ratio(cols: dict[str, dict[str, float]], row: str) -> float:
    return cols["rsmem"][row] / cols["llama.cpp"][row] if "llama.cpp" in cols else float("nan")


def print_arch(arch: str, cols, step_s, args: argparse.Namespace, ceilings: dict[int, float]) -> None:
    compiled = ", rsmem decode compiled" if step_s["compiled"] else ", rsmem decode eager"
    print(f"\n{arch} 130M, f32, {args.threads} threads{compiled}: tokens/s", flush=True)
    names = list(cols)
    print(f"{'':12}" + "".join(f"{c:>14}" for c in names) + f"{'rsmem/llama':>13}{'of ceiling':>12}")
    for row in ROWS:
        line = f"{row:12}" + "".join(f"{cols[c].get(row, float('nan')):14.1f}" for c in names)
        rows = args.prompt if row == "prefill" else int(row[6:])
        gflops = cols["rsmem"][row] * step_s["flops_per_token"] / 1e9
        print(line + f"{ratio(cols, row):13.2f}{gflops / ceilings[rows]:12.0%}", flush=True)


def print_side_by_side(results: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> None:
    """One table: for each architecture rsmem, transformers, llama.cpp and rsmem / llama.cpp."""
    names, widths = ("rsmem", "transformers", "llama.cpp"), (9, 14, 11, 13)
    block = sum(widths)
    print(f"\nboth architectures, 130M, f32, {args.threads} threads, prompt {args.prompt}: tokens/s")
    print(f"{'':12}" + "".join(f"{arch:>{block}}" for arch in results))
    print(f"{'':12}" + "".join(f"{n:>{w}}" for n, w in zip((*names, "rsmem/llama"), widths)) * len(results))
    for row in ROWS:
        line = f"{row:12}"
        for cols in results.values():
            line += "".join(f"{cols.get(n, {}).get(row, float('nan')):{w}.1f}" for n, w in zip(names, widths))
            line += f"{ratio(cols, row):{widths[-1]}.2f}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["mamba", "mamba2", "both"], default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per sequence count")
    ap.add_argument("--llama-python", default=None, help="python with llama-cpp-python==0.3.36 installed")
    ap.add_argument("--compile", choices=["auto", "1", "0"], default="auto", help="rsmem's decode compile")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-transformers-mamba2", action="store_true", help="skip transformers' (slow) Mamba-2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ceilings = {n: matmul_ceiling(n) for n in (*DECODE_SEQS, args.prompt)}
    print("torch f32 matmul ceiling (GFLOP/s):", {k: round(v, 1) for k, v in ceilings.items()})
    archs = ["mamba", "mamba2"] if args.arch == "both" else [args.arch]
    results = {}
    for arch in archs:
        results[arch], step_s = bench_arch(arch, args)
        print_arch(arch, results[arch], step_s, args, ceilings)
    if len(results) > 1:
        print_side_by_side(results, args)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
