"""rsmem: recurrent language models on a recurrent-state memory with llama.cpp's semantics."""

# first: Ctrl-C while the rsmem command loads torch exits quietly (rsmem.startup; other programs: no change)
import rsmem.startup  # isort: skip

# before anything imports torch: OpenMP's idle threads sleep instead of spinning (rsmem.threads)
import rsmem.threads  # isort: skip
import rsmem.malloc  # isort: skip
from rsmem.batch import Batch, BatchAllocator, UBatch
from rsmem.context import Context
from rsmem.engine import LLM, Engine, RequestOutput, SamplingParams
from rsmem.errors import (
    InvalidBatchError,
    ModelFormatError,
    NoSlotError,
    RsmemError,
    StateFormatError,
    UnknownSequenceError,
)
from rsmem.loaders import convert_hf_to_gguf, load_model
from rsmem.memory import MemoryStatus, RecurrentMemory, RecurrentMemoryContext, StateShape

# torch has loaded (and libgomp read the policy): the process's environment is the user's again
rsmem.threads.restore_environment()
# repeated steps reuse freed heap instead of faulting fresh pages in (rsmem.malloc)
rsmem.malloc.keep_freed_memory()

__version__ = "0.1.0"

convert = convert_hf_to_gguf  # rsmem.convert(hf_dir, out_path, outtype)

__all__ = [
    "LLM",
    "Batch",
    "BatchAllocator",
    "Context",
    "Engine",
    "InvalidBatchError",
    "MemoryStatus",
    "ModelFormatError",
    "NoSlotError",
    "RecurrentMemory",
    "RecurrentMemoryContext",
    "RequestOutput",
    "RsmemError",
    "SamplingParams",
    "StateFormatError",
    "StateShape",
    "UBatch",
    "UnknownSequenceError",
    "convert",
    "convert_hf_to_gguf",
    "load_model",
]
