"""Per-cell bookkeeping of the recurrent memory, kept apart from the tensors it describes.

A cell is one row of every state tensor. ``seqs[c]`` are the sequences whose current state is row ``c``;
``tail[s]`` is the cell holding sequence ``s`` (so a sequence id doubles as an index into ``tail``).
The two always agree: ``tail[s] == c`` exactly when ``s in seqs[c]``. That invariant is what lets
``find_slot`` update tails from the seq sets of the two cells it swaps, instead of scanning every cell.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CellTable:
    """Parallel lists, one entry per cell (``tail`` is indexed by sequence id instead)."""

    pos: list[int]
    src: list[int]  # row where this cell's data lies now (-1: none); find_slot moves it to the cell
    src0: list[int]  # staged source row for the model's gather (llama.cpp's s_copy)
    tail: list[int]  # per sequence id: the cell holding its state, or -1
    seqs: list[set[int]]

    @classmethod
    def empty(cls, size: int) -> CellTable:
        return cls(
            pos=[-1] * size,
            src=[-1] * size,
            src0=[-1] * size,
            tail=[-1] * size,
            seqs=[set() for _ in range(size)],
        )

    def copy(self) -> CellTable:
        return CellTable(
            pos=list(self.pos),
            src=list(self.src),
            src0=list(self.src0),
            tail=list(self.tail),
            seqs=[set(s) for s in self.seqs],
        )

    def is_empty(self, c: int) -> bool:
        return not self.seqs[c]

    def free(self, c: int) -> None:
        """Forget cell ``c``'s contents (its row is left as is; nothing reads it any more)."""
        self.pos[c] = -1
        self.src[c] = -1
        self.seqs[c].clear()

    def detach(self, seq: int) -> bool:
        """Remove ``seq`` from its cell; free the cell if no sequence is left. True if a cell was freed."""
        c = self.tail[seq]
        if c < 0:
            return False
        self.tail[seq] = -1
        self.seqs[c].discard(seq)
        if not self.seqs[c]:
            self.free(c)
            return True
        return False

    def swap(self, a: int, b: int) -> None:
        """Exchange the metadata of cells ``a`` and ``b`` and repoint the tails of their sequences."""
        if a == b:
            return
        self.pos[a], self.pos[b] = self.pos[b], self.pos[a]
        self.src[a], self.src[b] = self.src[b], self.src[a]
        self.seqs[a], self.seqs[b] = self.seqs[b], self.seqs[a]
        for s in self.seqs[a]:
            self.tail[s] = a
        for s in self.seqs[b]:
            self.tail[s] = b

    def n_used(self) -> int:
        return sum(1 for s in self.seqs if s)
