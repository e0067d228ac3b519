"""Make tests/fixtures/quantize/: what llama.cpp's own quantizer writes for tiny f32 Mamba and Mamba-2 files.

The f32 sources come from ``tests/quantize/quant_tiny_models.py`` (integer arithmetic, no RNG, so a test
rebuilds them byte for byte; their sha256 is recorded). Each source is quantized to every type by llama.cpp
(``llama_cpp.llama_model_quantize``, default parameters, run by ``--llama-python``, a venv holding
llama-cpp-python), and so are three requantizations (a quantized or f16/bf16 file as the input, as
llama.cpp's ``--allow-requantize`` does). ``llamacpp.json`` records, per output file, its size and sha256
and per tensor its type, ggml shape and the sha256 of its bytes; ``--keep T,...`` copies llama.cpp's files
of those types too (``{arch}-{type}.gguf``).

    .venv/bin/python scripts/make_quant_fixtures.py --llama-python /tmp/llvenv/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "quantize"))
import quant_tiny_models  # noqa: E402

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
# (arch, input type, output type): llama.cpp reads a quantized or 16-bit file and quantizes again
REQUANT = [("mamba2", "q8_0", "q4_k_m"), ("mamba", "f16", "q5_k_m"), ("mamba2", "bf16", "q4_0")]

LLAMA_QUANTIZE = """
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.allow_requantize = True
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(rc)
"""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe(path: Path) -> dict[str, object]:
    """The file's size and sha256, and per tensor its type, ggml shape and the sha256 of its bytes."""
    reader = gguf.GGUFReader(path)
    return {
        "size": path.stat().st_size,
        "sha256": sha256(path.read_bytes()),
        "tensors": {
            t.name: {
                "type": t.tensor_type.name,
                "shape": [int(d) for d in t.shape],
                "sha256": sha256(t.data.tobytes()),
            }
            for t in reader.tensors
        },
    }


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
    ap.add_argument("--keep", default="", help="comma-separated types whose llama.cpp files are copied")
    args = ap.parse_args()
    keep = [k for k in args.keep.split(",") if k]
    version = subprocess.run(
        [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    OUT.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"llama_cpp_python": version, "sources": {}, "outputs": {}, "requant": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for arch in quant_tiny_models.ARCHS:
            src = quant_tiny_models.write_model(arch, work / f"{arch}-f32-src.gguf")
            record["sources"][arch] = sha256(src.read_bytes())  # type: ignore[index]
            outs: dict[str, object] = {}
            for name, ftype in FTYPES.items():
                dst = work / f"{arch}-{name}.gguf"
                llama_quantize(args.llama_python, src, dst, int(ftype))
                outs[name] = describe(dst)
                if name in keep:
                    shutil.copyfile(dst, OUT / dst.name)
                print(f"{arch} {name}: {dst.stat().st_size} bytes", flush=True)
            record["outputs"][arch] = outs  # type: ignore[index]
        for arch, src_type, dst_type in REQUANT:
            dst = work / f"{arch}-{src_type}-to-{dst_type}.gguf"
            llama_quantize(args.llama_python, work / f"{arch}-{src_type}.gguf", dst, int(FTYPES[dst_type]))
            record["requant"][f"{arch}:{src_type}:{dst_type}"] = describe(dst)  # type: ignore[index]
            print(f"{arch} {src_type} -> {dst_type}: {dst.stat().st_size} bytes", flush=True)
    (OUT / "llamacpp.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
