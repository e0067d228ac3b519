"""Kernels of the Mamba mixers, each with a plain reference twin that tests compare it against.

Shapes follow the models: ``Bs`` sequences, ``L`` tokens, ``D`` channels (``d_inner``), ``N`` = ``d_state``,
``H`` heads of ``P`` = ``head_dim`` channels, ``G`` groups, ``K`` = ``d_conv``. A name ending in ``_``
updates its state argument in place (what the models call); the name without it works on a copy. A name
with ``_at`` also returns the states after chosen points ``(b, t)`` (sequence ``b`` after its token ``t``):
how a checkpoint is captured inside a micro-batch (``rsmem.memory.capture``).
"""

from rsmem.models.ops.conv import (
    causal_conv1d,
    causal_conv1d_,
    causal_conv1d_ref,
    conv_windows_at,
    conv_windows_at_ref,
)
from rsmem.models.ops.norm import gated_group_rms_norm, rms_norm
from rsmem.models.ops.selective_scan import (
    selective_scan,
    selective_scan_,
    selective_scan_at_,
    selective_scan_ref,
    selective_state_step,
    selective_state_update_,
    selective_states_at_ref,
)
from rsmem.models.ops.ssd import (
    ssd_chunked,
    ssd_chunked_,
    ssd_chunked_at_,
    ssd_ref,
    ssd_state_step,
    ssd_state_update_,
    ssd_states_at_ref,
)

__all__ = [
    "causal_conv1d",
    "causal_conv1d_",
    "causal_conv1d_ref",
    "conv_windows_at",
    "conv_windows_at_ref",
    "gated_group_rms_norm",
    "rms_norm",
    "selective_scan",
    "selective_scan_",
    "selective_scan_at_",
    "selective_scan_ref",
    "selective_state_step",
    "selective_state_update_",
    "selective_states_at_ref",
    "ssd_chunked",
    "ssd_chunked_",
    "ssd_chunked_at_",
    "ssd_ref",
    "ssd_state_step",
    "ssd_state_update_",
    "ssd_states_at_ref",
]
