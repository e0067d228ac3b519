"""StepMemo: a step's built operands kept while its key holds the very same objects."""

from __future__ import annotations

import torch

from rsmem.models.step.memo import StepMemo, same_objects


def test_same_objects_compares_identity_never_values() -> None:
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, two objects (== would give a tensor)
    assert same_objects([a, b], [a, b])
    assert not same_objects([a, b], [a, a])
    assert not same_objects([a], [a, b])


def test_memo_rebuilds_when_any_key_object_changes() -> None:
    built: list[int] = []

    def build() -> list[int]:
        built.append(len(built))
        return [len(built)]

    memo: StepMemo[list[int]] = StepMemo()
    rows = [torch.zeros(1), torch.zeros(1)]
    first = memo.get(("w", *rows), build)
    assert memo.get(("w", *rows), build) is first and built == [0]
    moved = [rows[0], torch.zeros(1)]  # one row another object, equal in value
    assert memo.get(("w", *moved), build) == [2] and built == [0, 1]
    assert memo.get(("w", *rows), build) == [3]  # only the last key is kept
