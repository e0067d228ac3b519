"""Build llama.cpp's ``llama-server`` (CPU only) for bench/server_vs_llamaserver.py.

A benchmark dependency only: nothing under src/ or tests/ imports it. The source is the llama.cpp vendored
in the llama-cpp-python 0.3.36 sdist (llama.cpp b11312): an extracted copy is used when given or found
under /tmp/lcp, otherwise the sdist is fetched with ``pip download`` into a temporary folder. The build
goes to a folder outside the repository (default ~/.cache/rsmem-bench/llama-server-b11312) and an
existing binary there is reused.

    python bench/llamaserver_build.py [--build-dir DIR] [--source DIR] [--jobs 2]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_VERSION = "0.3.36"
LLAMA_BUILD_NUMBER = "11312"
DEFAULT_BUILD_DIR = Path.home() / ".cache" / "rsmem-bench" / f"llama-server-b{LLAMA_BUILD_NUMBER}"
KNOWN_SOURCE = Path(f"/tmp/lcp/llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp")

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_BUILD_NUMBER}",
)


def server_binary(build_dir: Path) -> Path:
    """Where the build leaves ``llama-server``."""
    return build_dir / "bin" / "llama-server"


def fetch_source(workdir: Path) -> Path:
    """Download and extract the llama-cpp-python sdist; returns its vendor/llama.cpp."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += [f"llama-cpp-python=={SDIST_VERSION}", "-d", str(workdir)]
    subprocess.run(cmd, check=True)
    archive = next(workdir.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    return workdir / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"


def build(source: Path, build_dir: Path, jobs: int) -> Path:
    """Configure and build the llama-server target; returns the binary."""
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is needed to build llama-server")
    build_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS], check=True)
    cmd = ["cmake", "--build", str(build_dir), "--config", "Release", "--target", "llama-server"]
    subprocess.run([*cmd, f"-j{jobs}"], check=True)
    return server_binary(build_dir)


def ensure_llama_server(
    build_dir: Path = DEFAULT_BUILD_DIR, source: Path | None = None, jobs: int = 2
) -> Path:
    """Path to a built llama-server, building it first when missing."""
    binary = server_binary(build_dir)
    if binary.is_file():
        return binary
    if source is None and KNOWN_SOURCE.is_dir():
        source = KNOWN_SOURCE
    if source is not None:
        return build(source, build_dir, jobs)
    with tempfile.TemporaryDirectory(prefix="lcp-sdist-") as tmp:
        return build(fetch_source(Path(tmp)), build_dir, jobs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD_DIR)
    parser.add_argument("--source", type=Path, default=None, help="an extracted llama.cpp source tree")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    print(ensure_llama_server(args.build_dir.expanduser(), args.source, args.jobs))


if __name__ == "__main__":
    main()
