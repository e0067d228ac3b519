"""Every architecture rsmem runs, by its GGUF name: its family, how its config is read from GGUF metadata
and how its model is built from a :class:`~rsmem.loaders.tensors.ModelTensors`.

The loaders dispatch through :data:`ARCHS` (``gguf.py`` reads a config with :func:`arch`'s
``config_from_gguf``; :func:`build_model` builds). Adding an architecture is a family module (the model
under ``rsmem.models.<family>``, its tensor names and builder under ``rsmem.loaders``) and one entry here;
``docs/architecture.md`` walks through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders import mamba
from rsmem.loaders.hybrid import build as hybrid
from rsmem.loaders.rwkv import build as rwkv
from rsmem.loaders.tensors import ModelTensors
from rsmem.models.hybrid.lfm2 import Lfm2Model
from rsmem.models.hybrid.nemotron_h import NemotronHModel
from rsmem.models.hybrid.qwen35 import Qwen35Model
from rsmem.models.mamba.mamba1 import MambaModel
from rsmem.models.mamba.mamba2 import Mamba2Model
from rsmem.models.step.compiled import CompileSetting

ConfigReader = Callable[[str, Callable[[str], object], int, Callable[[str], "object | None"]], Any]
Builder = Callable[[ModelTensors, torch.dtype, CompileSetting], Any]


@dataclass(frozen=True)
class Arch:
    """One architecture: ``name`` as GGUF's ``general.architecture`` spells it, its ``family`` ("mamba",
    "rwkv" or "hybrid"), ``config_from_gguf(arch, key, n_vocab, optional)`` reading its ``{arch}.*``
    metadata (``key`` raises ModelFormatError for a missing key) and ``build(tensors, dtype, compile)``."""

    name: str
    family: str
    config_from_gguf: ConfigReader
    build: Builder


def _family(name: str, archs: tuple[str, ...], config: ConfigReader, build: Builder) -> dict[str, Arch]:
    return {a: Arch(a, name, config, build) for a in archs}


# the order of SUPPORTED_ARCHS, which error messages list
ARCHS: dict[str, Arch] = {
    **_family("mamba", mamba.MAMBA_ARCHS, mamba.config_from_gguf, mamba.build_mamba),
    **_family("hybrid", hybrid.HYBRID_ARCHS, hybrid.config_from_gguf, hybrid.build_hybrid),
    **_family("rwkv", rwkv.RWKV_ARCHS, rwkv.config_from_gguf, rwkv.build_rwkv),
}
SUPPORTED_ARCHS = tuple(ARCHS)


def arch(name: str) -> Arch:
    """The registry's entry for ``name``; ModelFormatError when rsmem does not run it."""
    entry = ARCHS.get(name)
    if entry is None:
        raise ModelFormatError(f"unsupported architecture {name!r} (supported: {SUPPORTED_ARCHS})")
    return entry


def archs_of(family: str) -> tuple[str, ...]:
    """The architectures of one family, in registry order."""
    return tuple(a.name for a in ARCHS.values() if a.family == family)


def build_model(
    ckpt: ModelTensors, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
) -> MambaModel | Mamba2Model | Lfm2Model | NemotronHModel | Qwen35Model:
    """Make the model of ``ckpt.arch`` from its tensors (``compile``: see ``set_compile`` of the models)."""
    entry = ARCHS.get(ckpt.arch)
    if entry is None:
        raise ModelFormatError(f"{ckpt.source}: unsupported architecture {ckpt.arch!r}")
    return entry.build(ckpt, dtype, compile)
