"""Checkpoint.is_finite: any NaN or inf in any row refuses the checkpoint, in every codec."""

from __future__ import annotations

import pytest
import torch

from rsmem.memory.checkpoint import Checkpoint, encode


def checkpoint_of(rows: list[torch.Tensor], codec: str) -> Checkpoint:
    enc = tuple(encode(r, codec) for r in rows)
    return Checkpoint(5, codec, enc, (None,) * len(enc))


@pytest.mark.parametrize("codec", ["exact", "bf16", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "both"])
def test_one_bad_value_in_any_row_is_seen(codec, bad):
    rows = [torch.randn(1, 300) for _ in range(3)]
    assert checkpoint_of(rows, codec).is_finite()
    if bad == "both":  # +inf and -inf in one row: its sum is NaN
        rows[1][0, 7], rows[1][0, 200] = float("inf"), -float("inf")
    else:
        rows[2][0, 123] = bad
    assert not checkpoint_of(rows, codec).is_finite()


def test_large_finite_values_that_cancel_are_finite():
    row = torch.tensor([[3e38, -3e38, 1.0]])
    assert checkpoint_of([row], "exact").is_finite()


def test_a_checkpoint_without_rows_is_finite():
    assert Checkpoint(0, "exact", (None,), (None,)).is_finite()
