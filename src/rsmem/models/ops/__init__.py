"""Kernels of the Mamba mixers, each with a plain reference twin that tests compare it against.

Shapes follow the models: ``Bs`` sequences, ``L`` tokens, ``D`` channels (``d_inner``), ``N`` = ``d_state``,
``H`` heads of ``P`` = ``head_dim`` channels, ``G`` groups, ``K`` = ``d_conv``. A name ending in ``_``
updates its state argument in place (what the models call); the name without it works on a copy.
"""

from rsmem.models.ops.conv import causal_conv1d, causal_conv1d_, causal_conv1d_ref
from rsmem.models.ops.norm import gated_group_rms_norm, rms_norm
from rsmem.models.ops.selective_scan import (
    selective_scan,
    selective_scan_,
    selective_scan_ref,
    selective_state_step,
    selective_state_update_,
)
from rsmem.models.ops.ssd import ssd_chunked, ssd_chunked_, ssd_ref, ssd_state_step, ssd_state_update_

__all__ = [
    "causal_conv1d",
    "causal_conv1d_",
    "causal_conv1d_ref",
    "gated_group_rms_norm",
    "rms_norm",
    "selective_scan",
    "selective_scan_",
    "selective_scan_ref",
    "selective_state_step",
    "selective_state_update_",
    "ssd_chunked",
    "ssd_chunked_",
    "ssd_ref",
    "ssd_state_step",
    "ssd_state_update_",
]
