"""The operands of the C++ decode steps' layers, by name: one :class:`StepOperands` a step (and one a block
kind of the hybrid step), the single list of what a layer passes and in which order.

The Python side derives from it what it passes by position (:class:`~rsmem.models.step.native.NativeStep`'s
``n_fields`` and matrix positions, the hybrid blocks' counts, the layers' operand tuples); each C++ step
indexes its operands by enums of the same names in the same order, ``<name>Field`` for the tensors and
``<name>Matrix`` for the qtypes, one for each matrix in field order (``t[Mamba2Field::IN_PROJ]``,
``q[Mamba2Matrix::IN_PROJ]``). tests/kernels/test_step_operands.py compares the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StepOperands:
    """A layer's operands of a C++ step: ``fields`` in the op's order; ``matrices`` those passed with a
    qtype each (in field order); ``states`` those a step fills in (the layer's states or KV rows, last in
    the decode steps); ``name`` the C++ enums' prefix."""

    name: str
    fields: tuple[str, ...]
    matrices: tuple[str, ...]
    states: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"{self.name}: a field is named twice")
        if tuple(f for f in self.fields if f in self.matrices) != self.matrices:
            raise ValueError(f"{self.name}: matrices must be fields, in field order")
        if not set(self.states) <= set(self.fields) - set(self.matrices):
            raise ValueError(f"{self.name}: states must be fields other than the matrices")

    @property
    def n_fields(self) -> int:
        return len(self.fields)

    @property
    def matrix_positions(self) -> tuple[int, ...]:
        return tuple(self.fields.index(m) for m in self.matrices)

    @property
    def state_positions(self) -> tuple[int, ...]:
        return tuple(self.fields.index(s) for s in self.states)

    @property
    def weights(self) -> tuple[str, ...]:
        """The fields but the states: what a layer holds."""
        return tuple(f for f in self.fields if f not in self.states)

    def of(self, layer: Any, operand: Callable[[Any], Any]) -> tuple[Any, ...]:
        """``layer``'s attributes of the :attr:`weights` names, each matrix as ``operand`` gives it."""
        return tuple(
            operand(getattr(layer, f)) if f in self.matrices else getattr(layer, f) for f in self.weights
        )


MAMBA = StepOperands(
    "Mamba",
    fields=(
        "norm", "in_proj", "conv_weight", "conv_bias", "x_proj", "dt_proj", "dt_bias", "A", "D", "out_proj",
        "window", "h",
    ),
    matrices=("in_proj", "x_proj", "out_proj"),
    states=("window", "h"),
)  # fmt: skip

MAMBA2 = StepOperands(
    "Mamba2",
    fields=(
        "norm", "in_proj", "conv_weight", "conv_bias", "dt_bias", "A", "D", "ssm_norm", "out_proj", "window",
        "h",
    ),
    matrices=("in_proj", "out_proj"),
    states=("window", "h"),
)  # fmt: skip

# RWKV's layers: the fields the compiled steps take too (rsmem.models.step.wkv_fused), then the token-shift
# rows and the WKV state
RWKV6_FIELDS = (
    "attn_norm", "attn_norm_b", "ffn_norm", "ffn_norm_b", "lerp_x", "lerp", "w1", "w2", "decay", "decay_w1",
    "decay_w2", "first", "receptance", "key", "value", "gate", "output", "ln_x", "ln_x_b", "ffn_lerp_k",
    "ffn_lerp_r", "ffn_key", "ffn_value", "ffn_receptance",
)  # fmt: skip
RWKV6 = StepOperands(
    "Rwkv6",
    fields=(*RWKV6_FIELDS, "shift", "wkv"),
    matrices=("receptance", "key", "value", "gate", "output", "ffn_key", "ffn_value", "ffn_receptance"),
    states=("shift", "wkv"),
)

RWKV7_FIELDS = (
    "attn_norm", "attn_norm_b", "ffn_norm", "ffn_norm_b", "lerp", "w0", "w1", "w2", "a0", "a1", "a2",
    "v0", "v1", "v2", "g1", "g2", "k_k", "k_a", "r_k", "receptance", "key", "value", "output", "ln_x",
    "ln_x_b", "ffn_lerp_k", "ffn_key", "ffn_value",
)  # fmt: skip
RWKV7 = StepOperands(
    "Rwkv7",
    fields=(*RWKV7_FIELDS, "shift", "wkv"),
    matrices=("receptance", "key", "value", "output", "ffn_key", "ffn_value"),
    states=("shift", "wkv"),
)

# The hybrid step's block kinds (rsmem.models.hybrid.native); a Mamba-2 block is MAMBA2. ``states``: what
# each step fills in (the layer's window; its KV cache's rows).
CONV_BLOCK = StepOperands(
    "Conv",
    fields=("norm", "conv_in", "conv", "conv_out", "window"),
    matrices=("conv_in", "conv_out"),
    states=("window",),
)
# SwiGLU's (``up``: its gate rows, then its up rows) and ReLU²'s MLP
MLP_BLOCK = StepOperands("Mlp", fields=("norm", "up", "down"), matrices=("up", "down"))
ATTENTION_BLOCK = StepOperands(
    "Attention",
    fields=("norm", "wqkv", "q_norm", "k_norm", "wo", "k_rows", "v_rows"),
    matrices=("wqkv", "wo"),
    states=("k_rows", "v_rows"),
)

# every step's operands, for the test that holds the C++ enums to them
ALL = (MAMBA, MAMBA2, RWKV6, RWKV7, CONV_BLOCK, MLP_BLOCK, ATTENTION_BLOCK)
