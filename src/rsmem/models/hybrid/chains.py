"""A hybrid model's decode step as compiled chains (:func:`.ops.hybrid_fused.chain`).

The step is a list of layer steps: :class:`Step` (a block of :mod:`rsmem.models.step.hybrid_fused` with its
tensors) and :class:`AttentionStep` (an attention layer: its q/k/v part ends a chain, the KV cache's store
and attention run eagerly, its output part starts the next chain). So a token costs one compiled call per
stretch between attention layers plus the head's, instead of one per layer: each call costs tens of
microseconds in dynamo's guards and Python before its kernels run, and eagerly the glue between the
products is a dozen small ops a layer, each a parallel region of its own. Chains of the same blocks (the
repeating stretches of a layer pattern) share one compilation; each is checked before first use
(:class:`~rsmem.models.step.compiled.CompiledStep`, eager fallback).

:class:`Chains` comes in two kinds: one sequence (``many=False``: ``*_one`` blocks, static shapes) and one
token of each of several sequences (``many=True``: ``*_many`` blocks with few-row products, the batch
dimension of the residual, the state rows, attention's output and the RoPE tables dynamic, so every width
of two or more shares one compilation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from rsmem.models.step.compiled import GLUE_MIN_CHUNK, ONE_THREAD_GLUE, CompiledStep
from rsmem.models.step.fused import SmallRows, gemv, matmul_rows
from rsmem.models.step.hybrid_fused import ATTN_IN_BATCH, ATTN_IN_TENSORS, Block, chain

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(slots=True)
class Step:
    block: Block
    tensors: tuple[Any, ...]  # tensors, Packed matrices, None for absent ones


@dataclass(slots=True)
class AttentionStep:
    """Layer ``il``: ``attn_in`` tensors (norm, wqkv, q_norm, k_norm, cos, sin) and constants (n_head,
    n_head_kv, eps); after attention, ``out`` runs on ``(x, o, *out_tensors)``."""

    il: int
    attn_in: tuple[Any, ...]
    consts: tuple[int, int, float]
    scale: float
    out: Block
    out_tensors: tuple[Any, ...]


class Chains:
    """The compiled chains of one model, by their blocks: for one sequence, or (``many``) for one token of
    each of several sequences."""

    def __init__(self, many: bool = False) -> None:
        self.many = many
        self._steps: dict[tuple[object, ...], CompiledStep[object]] = {}

    def _step(
        self, blocks: tuple[Block, ...], tail: str, consts: tuple[float | int, ...], args: tuple[Any, ...]
    ) -> CompiledStep[object]:
        key = (blocks, tail, consts, tuple(a is None for a in args))
        found = self._steps.get(key)
        if found is None:
            mutated, batch, at = [], [0], 1  # argument 0 is x
            for b in blocks:
                mutated += [at + m for m in b.mutated]
                batch += [at + m for m in (*b.mutated, *b.batch)]
                at += b.n
            if tail == "attn_in":
                batch += [at + i for i in ATTN_IN_BATCH if isinstance(args[at + i], torch.Tensor)]
            product = matmul_rows if self.many else gemv
            fn = chain(blocks, tail, consts, product)
            batch_args = tuple(batch) if self.many else ()
            # glue on one thread where the products are not inductor's (a hand-off to a sleeping OpenMP
            # partner costs more than a norm saves); one sequence's chains with the few-row kernel's
            # products keep every inductor kernel there (Nemotron-H's Mamba-2 state update too)
            if self.many:
                options: dict[str, Any] | None = {"cpp.min_chunk_size": GLUE_MIN_CHUNK}
            elif any(isinstance(a, SmallRows) for a in args):
                options = dict(ONE_THREAD_GLUE)
            else:
                options = None
            found = CompiledStep(fn, batch_args=batch_args, mutated=tuple(mutated), options=options)
            self._steps[key] = found
        return found

    @property
    def steps(self) -> list[CompiledStep[object]]:
        return list(self._steps.values())

    def run(
        self,
        x: torch.Tensor,
        layers: Sequence[Step | AttentionStep],
        tail: str,
        tail_tensors: tuple[Any, ...],
        eps: float,
        attend: Attend,
    ) -> torch.Tensor:
        """The layer steps on the residual ``x`` ``[Bs, d_model]``, then ``tail``: ``"head"`` (``norm_f``,
        the head) gives the logits, ``"norm"`` (``norm_f``) the normed rows; ``attend(il, q, k, v,
        scale)`` is the KV cache's part."""
        blocks: list[Block] = []
        flat: list[Any] = []
        for st in layers:
            if isinstance(st, Step):
                blocks.append(st.block)
                flat += st.tensors
                continue
            assert len(st.attn_in) == ATTN_IN_TENSORS
            args = (x, *flat, *st.attn_in)
            out = self._step(tuple(blocks), "attn_in", st.consts, args)(*args)
            x, q, k, v = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], out)
            o = attend(st.il, q, k, v, st.scale)
            blocks, flat = [st.out], [o, *st.out_tensors]
        args = (x, *flat, *tail_tensors)
        result = self._step(tuple(blocks), tail, (eps,), args)(*args)
        assert isinstance(result, torch.Tensor)
        return result
