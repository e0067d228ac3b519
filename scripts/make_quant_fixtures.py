"""Make tests/fixtures/quantize/: what llama.cpp's own quantizer writes for tiny f32 Mamba and Mamba-2 files.

The f32 sources come from ``tests/helpers/quant_tiny_models.py`` (integer arithmetic, no RNG, so a test
rebuilds them byte for byte; their sha256 is recorded). Each source is quantized to every preset by
llama.cpp (``llama_cpp.llama_model_quantize``, default parameters, run by ``--llama-python``, a venv
holding llama-cpp-python), and so are the f32 hybrid and RWKV fixtures already in the repository, and six
requantizations (a quantized or f16/bf16 file as the input, as llama.cpp's ``--allow-requantize`` does).
``llamacpp.json`` records the sources' sha256 and, per output file, its size and sha256 and per tensor
its type and the sha256 of its bytes (16 hex digits); three of llama.cpp's files are kept whole
(``llamacpp-{source}-{type}.gguf``).

    .venv/bin/python scripts/make_quant_fixtures.py --llama-python /tmp/llvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import quant_tiny_models  # noqa: E402
from helpers.quant_tiny_models import describe, sha256  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "quantize"
LFT = gguf.LlamaFileType
FTYPES = {
    "f32": LFT.ALL_F32,
    "f16": LFT.MOSTLY_F16,
    "bf16": LFT.MOSTLY_BF16,
    "q8_0": LFT.MOSTLY_Q8_0,
    "q4_0": LFT.MOSTLY_Q4_0,
    "q4_1": LFT.MOSTLY_Q4_1,
    "q5_0": LFT.MOSTLY_Q5_0,
    "q5_1": LFT.MOSTLY_Q5_1,
    "q2_k": LFT.MOSTLY_Q2_K,
    "q3_k_s": LFT.MOSTLY_Q3_K_S,
    "q3_k_m": LFT.MOSTLY_Q3_K_M,
    "q3_k_l": LFT.MOSTLY_Q3_K_L,
    "q4_k_s": LFT.MOSTLY_Q4_K_S,
    "q4_k_m": LFT.MOSTLY_Q4_K_M,
    "q5_k_s": LFT.MOSTLY_Q5_K_S,
    "q5_k_m": LFT.MOSTLY_Q5_K_M,
    "q6_k": LFT.MOSTLY_Q6_K,
}
# f32 files already in the repository (hybrids and RWKV: attn_v/ffn_down layers, 64-wide rows that fall back)
REPO_SOURCES = {
    "lfm2": "tests/fixtures/llamacpp/lfm2/model-f32.gguf",
    "nemotron_h": "tests/fixtures/llamacpp/nemotron_h/model-f32.gguf",
    "rwkv6": "tests/fixtures/llamacpp/rwkv/rwkv6/model-f32.gguf",
    "rwkv7": "tests/fixtures/llamacpp/rwkv/rwkv7/model-f32.gguf",
}
# requantization (llama.cpp's --allow-requantize): (source, type); a source "tiny-A@T" is llama.cpp's
# output of type T for the tiny model A (a test rebuilds it with rsmem quantize, which writes the same bytes)
REQUANT = [
    ("tiny-mamba2@q8_0", "q4_k_m"),
    ("tiny-mamba@f16", "q5_k_m"),
    ("tiny-mamba2@bf16", "q4_0"),
    ("tests/fixtures/llamacpp/quant/mamba2/model-q4_k_m.gguf", "q6_k"),
    ("tests/fixtures/llamacpp/quant/mamba/model-q6_k.gguf", "q4_k_s"),
    ("tests/fixtures/llamacpp/mamba/model-q8_0.gguf", "q5_k_m"),
]
# llama.cpp's files kept whole (the test compares them byte for byte, not only by hash)
KEEP = [("tiny-mamba2", "q4_k_m"), ("tiny-mamba", "q5_k_m"), ("tiny-mamba", "q6_k")]

LLAMA_QUANTIZE = """
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.allow_requantize = True
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(rc)
"""


def llama_quantize(llama_python: str, src: Path, dst: Path, ftype: int) -> None:
    subprocess.run(
        [llama_python, "-c", LLAMA_QUANTIZE, str(src), str(dst), str(ftype)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="python of a venv holding llama-cpp-python")
    args = ap.parse_args()
    version = subprocess.run(
        [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    OUT.mkdir(parents=True, exist_ok=True)
    sources: dict[str, str] = {}
    cases: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths: dict[str, Path] = {}
        for arch in quant_tiny_models.ARCHS:
            paths[f"tiny-{arch}"] = quant_tiny_models.write_model(arch, work / f"tiny-{arch}.gguf")
        paths.update({name: ROOT / rel for name, rel in REPO_SOURCES.items()})
        for name, path in paths.items():
            sources[name] = sha256(path.read_bytes())
            for ftype, file_type in FTYPES.items():
                dst = work / f"{name}@{ftype}.gguf"
                llama_quantize(args.llama_python, path, dst, int(file_type))
                cases.append({"source": name, "type": ftype, "output": describe(dst)})
                if (name, ftype) in KEEP:
                    shutil.copyfile(dst, OUT / f"llamacpp-{name}-{ftype}.gguf")
                print(f"{name} -> {ftype}: {dst.stat().st_size} bytes", flush=True)
        for src, ftype in REQUANT:
            path = work / f"{src}.gguf" if src.startswith("tiny-") else ROOT / src
            sources.setdefault(src, sha256(path.read_bytes()))
            dst = work / "requant.gguf"
            llama_quantize(args.llama_python, path, dst, int(FTYPES[ftype]))
            cases.append({"source": src, "type": ftype, "output": describe(dst)})
            print(f"{src} -> {ftype}: {dst.stat().st_size} bytes", flush=True)
    lines = ",\n".join(json.dumps(c, separators=(",", ":")) for c in cases)  # one case a line
    head = json.dumps({"llama_cpp_python": version, "sources": sources}, indent=1)[:-2]
    (OUT / "llamacpp.json").write_text(f'{head},\n "cases": [\n{lines}\n]}}\n')


if __name__ == "__main__":
    main()
