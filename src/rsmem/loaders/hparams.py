"""GGUF hyperparameters read within their ranges: each refusal is a ModelFormatError naming the full key
(``mamba2.ssm.group_count``).

The models divide, index and allocate by these values, so a corrupt or hand-edited file must fail here,
at load, rather than in their arithmetic. The rules:

- a count (layers, widths, heads, groups, ranks, kernel sizes) is a whole number, at least 1 unless the
  reader allows 0 (where 0 means none: a layer without key/value heads, a model without a gate);
- where a model splits one value into parts of another, the split is exact (:meth:`Hparams.divides`);
- a float is finite; an epsilon is at least 0, a RoPE base above 0.

An optional key the file lacks takes the reader's default; an optional key the file holds is checked like
any other (a 0 there is refused, never taken for "absent").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rsmem.errors import ModelFormatError

Lookup = Callable[[str], object]  # "{arch}.<key>" metadata value; raises ModelFormatError when missing
Optional = Callable[[str], object | None]  # the same, None when missing


def field_contents(field: Any, key: str) -> object:
    """A GGUF reader field's value (``field.contents()``); ModelFormatError naming ``key`` when its bytes
    do not decode (a string that is not UTF-8)."""
    try:
        return field.contents()
    except (ValueError, IndexError) as exc:  # UnicodeDecodeError is a ValueError
        raise ModelFormatError(f"metadata key {key!r} is corrupt ({exc})") from exc


class Hparams:
    """The ``{arch}.*`` metadata of one file, read as checked numbers (``k`` is the key without the
    ``{arch}.`` prefix; messages give the full key)."""

    def __init__(self, arch: str, key: Lookup, optional: Optional) -> None:
        self.arch = arch
        self._key = key
        self._optional = optional

    def name(self, k: str) -> str:
        return f"{self.arch}.{k}"

    def error(self, k: str, detail: str) -> ModelFormatError:
        return ModelFormatError(f"metadata key {self.name(k)!r} {detail}")

    def optional(self, k: str) -> object | None:
        return self._optional(k)

    # ------------------------------------------------------------- counts

    def count(self, k: str, minimum: int = 1) -> int:
        return self._count(self._key(k), k, minimum)

    def count_or(self, k: str, default: int, minimum: int = 1) -> int:
        value = self._optional(k)
        return default if value is None else self._count(value, k, minimum)

    def counts(self, k: str, n_layer: int, minimum: int = 0) -> tuple[int, ...]:
        """A per-layer count: an array of ``n_layer`` entries, or one number for every layer."""
        value = self._key(k)
        if isinstance(value, list):
            if len(value) != n_layer:
                raise self.error(k, f"has {len(value)} entries for {n_layer} layers (block_count)")
            return tuple(self._count(v, k, minimum, f" in layer {i}") for i, v in enumerate(value))
        return (self._count(value, k, minimum),) * n_layer

    def _count(self, value: object, k: str, minimum: int, where: str = "") -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(k, f"is {value!r}{where}, not a number")
        if value != value or value in (math.inf, -math.inf) or value != int(value):
            raise self.error(k, f"is {value!r}{where}, not a whole number")
        if value < minimum:
            raise self.error(k, f"is {int(value)}{where}, must be at least {minimum}")
        return int(value)

    def divides(self, part_key: str, part: int, whole_key: str, whole: int, where: str = "") -> None:
        """``whole`` (the value of ``whole_key``) splits into parts of ``part`` exactly."""
        if part < 1 or whole % part:
            raise ModelFormatError(
                f"metadata key {self.name(whole_key)!r} ({whole}) is not a multiple of "
                f"{self.name(part_key)!r} ({part}){where}"
            )

    # ------------------------------------------------------------- floats

    def number(self, k: str, minimum: float | None = None, *, above: bool = False) -> float:
        return self._number(self._key(k), k, minimum, above)

    def number_or(
        self, k: str, default: float, minimum: float | None = None, *, above: bool = False
    ) -> float:
        value = self._optional(k)
        return default if value is None else self._number(value, k, minimum, above)

    def epsilon(self, k: str) -> float:
        return self.number(k, 0.0)

    def epsilon_or(self, k: str, default: float) -> float:
        return self.number_or(k, default, 0.0)

    def _number(self, value: object, k: str, minimum: float | None, above: bool) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(k, f"is {value!r}, not a number")
        if not math.isfinite(value):
            raise self.error(k, f"is {value!r}, not a finite number")
        if minimum is not None and (value <= minimum if above else value < minimum):
            raise self.error(k, f"is {value!r}, must be {'above' if above else 'at least'} {minimum}")
        return float(value)


@contextmanager
def consistent() -> Iterator[None]:
    """A config's own ValueError (dimensions that do not fit together, a division by a zero count) as
    ModelFormatError; a ModelFormatError (a key out of its range) goes through as it is."""
    try:
        yield
    except ModelFormatError:
        raise
    except (ValueError, ZeroDivisionError) as exc:
        raise ModelFormatError(f"inconsistent hyperparameters ({exc})") from exc
