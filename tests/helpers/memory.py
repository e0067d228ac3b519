"""Helpers shared by the memory tests: snapshots for "nothing changed" checks, a plain replay model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rsmem import Batch, Context
from rsmem.memory.recurrent import RecurrentMemory, StateShape
from rsmem.models import DecayedSumModel


@dataclass
class MemorySnapshot:
    pos: list[int]
    src: list[int]
    tail: list[int]
    seqs: list[set[int]]
    head: int
    used: int
    rows: list[torch.Tensor]

    def assert_same(self, other: MemorySnapshot) -> None:
        assert self.pos == other.pos
        assert self.src == other.src
        assert self.tail == other.tail
        assert self.seqs == other.seqs
        assert self.head == other.head
        assert self.used == other.used
        assert len(self.rows) == len(other.rows)
        for a, b in zip(self.rows, other.rows):  # byte for byte: NaN == NaN, 0.0 != -0.0
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def snapshot(memory: RecurrentMemory) -> MemorySnapshot:
    c = memory.cells
    rows = [t.clone() for t in (*memory.r_l, *memory.s_l) if t is not None]
    return MemorySnapshot(
        list(c.pos), list(c.src), list(c.tail), [set(s) for s in c.seqs], memory.head, memory.used, rows
    )


def small_memory(n_seq_max: int = 4, n_layer: int = 2) -> RecurrentMemory:
    return RecurrentMemory(StateShape(n_layer, 3, 5), n_seq_max)


def decode_seq(ctx: Context, seq: int, tokens: list[int]) -> None:
    """Decode ``tokens`` as the continuation of sequence ``seq``, last token marked for output."""
    ctx.decode(Batch(tokens, seq_ids=[[seq]] * len(tokens)))


def toy_context(n_seq_max: int = 4, **kwargs) -> tuple[DecayedSumModel, Context]:
    model = DecayedSumModel(n_vocab=32, n_embd=4, n_layer=2)
    return model, Context(model, n_seq_max=n_seq_max, **kwargs)
