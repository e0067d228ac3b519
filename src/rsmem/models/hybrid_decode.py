"""A hybrid model's one-sequence decode step as compiled chains (:func:`.ops.hybrid_fused.chain`).

The step is a list of layer steps: :class:`Step` (a block of :mod:`rsmem.models.ops.hybrid_fused` with its
tensors) and :class:`AttentionStep` (an attention layer: its q/k/v part ends a chain, the KV cache's store
and attention run eagerly, its output part starts the next chain). So a token costs one compiled call per
stretch between attention layers plus the head's, instead of one per layer: each call costs tens of
microseconds in dynamo's guards and Python before its kernels run. Chains of the same blocks (the
repeating stretches of a layer pattern) share one compilation; each is checked before first use
(:class:`~rsmem.models.compiled.CompiledStep`, eager fallback).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from rsmem.models.compiled import CompiledStep
from rsmem.models.ops.hybrid_fused import ATTN_IN_TENSORS, Block, chain

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(slots=True)
class Step:
    block: Block
    tensors: tuple[torch.Tensor | None, ...]


@dataclass(slots=True)
class AttentionStep:
    """Layer ``il``: ``attn_in`` tensors (norm, wqkv, q_norm, k_norm, cos, sin) and constants (n_head,
    n_head_kv, eps); after attention, ``out`` runs on ``(x, o, *out_tensors)``."""

    il: int
    attn_in: tuple[torch.Tensor | None, ...]
    consts: tuple[int, int, float]
    scale: float
    out: Block
    out_tensors: tuple[torch.Tensor | None, ...]


class Chains:
    """The compiled chains of one model, by their blocks."""

    def __init__(self) -> None:
        self._steps: dict[tuple[object, ...], CompiledStep[object]] = {}

    def _step(
        self, blocks: tuple[Block, ...], tail: str, consts: tuple[float | int, ...]
    ) -> CompiledStep[object]:
        key = (blocks, tail, consts)
        found = self._steps.get(key)
        if found is None:
            mutated, at = [], 1  # argument 0 is x
            for b in blocks:
                mutated += [at + m for m in b.mutated]
                at += b.n
            found = CompiledStep(chain(blocks, tail, consts), mutated=tuple(mutated))
            self._steps[key] = found
        return found

    @property
    def steps(self) -> list[CompiledStep[object]]:
        return list(self._steps.values())

    def run(
        self,
        x: torch.Tensor,
        layers: Sequence[Step | AttentionStep],
        head: tuple[torch.Tensor, torch.Tensor],
        eps: float,
        attend: Attend,
    ) -> torch.Tensor:
        """The token's logits from the residual ``x`` ``[1, d_model]``: the layer steps, then the head
        (``norm_f``, ``lm_head`` rows); ``attend(il, q, k, v, scale)`` is the KV cache's part."""
        blocks: list[Block] = []
        flat: list[torch.Tensor | None] = []
        for st in layers:
            if isinstance(st, Step):
                blocks.append(st.block)
                flat += st.tensors
                continue
            assert len(st.attn_in) == ATTN_IN_TENSORS
            out = self._step(tuple(blocks), "attn_in", st.consts)(x, *flat, *st.attn_in)
            x, q, k, v = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], out)
            o = attend(st.il, q, k, v, st.scale)
            blocks, flat = [st.out], [o, *st.out_tensors]
        logits = self._step(tuple(blocks), "head", (eps,))(x, *flat, *head)
        assert isinstance(logits, torch.Tensor)
        return logits
