"""Which path runs a recurrent model's decode step: the C++ step, the compiled whole step, or the layers
one by one (:func:`decode_path`, the one rule of Mamba's and RWKV's bases)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rsmem.models.step.native import NativeStep

DecodePath = Literal["native", "compiled", "layers"]


def decode_path(
    native: NativeStep | None,
    n_seqs: int,
    *,
    compiled: bool,
    rows_contiguous: bool,
    native_without_compile: bool,
) -> DecodePath:
    """Which path runs a recurrent model's decode step of one token for each of ``n_seqs`` sequences (with no
    states captured): the one rule of Mamba's and RWKV's bases.

    - ``"native"``: the C++ step ``native``, where it runs here for ``n_seqs`` (:meth:`NativeStep.usable`),
      the matrices keep contiguous ``[out, in]`` rows (``rows_contiguous``), and the steps are ``compiled`` or
      the family runs its C++ step without compiling (``native_without_compile``: Mamba's). For the token
      where it does not take the operands (:meth:`NativeStep.accepts`) or fails its first check
      (:meth:`NativeStep.check`), the compiled step runs instead (not compiling: that step's function,
      eagerly).
    - ``"compiled"``: else the compiled whole step, where ``compiled`` and there are several sequences or
      the rows are contiguous (one sequence's step streams them).
    - ``"layers"``: else layer by layer, as a prompt.
    """
    if (
        native is not None
        and rows_contiguous
        and (compiled or native_without_compile)
        and native.usable(n_seqs)
    ):
        return "native"
    if compiled and (n_seqs > 1 or rows_contiguous):
        return "compiled"
    return "layers"
