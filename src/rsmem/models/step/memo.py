"""What a decode step builds from its state rows, kept while they are the very same objects.

A one-token step hands its op every layer's weights and state views as one flat list (~300 tensors for
the 130M RWKV-7). In steady decode the memory gives out the same row views step after step
(:class:`~rsmem.memory.context.RowViews`), so the views shaped from them, the flat list and what the op
derives from it (its operand list, :class:`~rsmem.models.step.native.NativeStep`) can be kept: each
such step then builds nothing. After the op has streamed the weights, Python's objects are out of the
caches, and every object a step touches costs a miss.

The memo holds its last key: the state rows of the last step (views of the memory, which they keep alive
until the next step of this model).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def same_objects(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects in order (compared at C level, never by value)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class StepMemo(Generic[T]):
    """The value ``build()`` gave for the last key, while the key's items are the same objects."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] = ()
        self._value: T | None = None

    def get(self, key: Sequence[Any], build: Callable[[], T]) -> T:
        if self._value is None or not same_objects(key, self._key):
            self._value = build()
            self._key = tuple(key)
        return self._value
