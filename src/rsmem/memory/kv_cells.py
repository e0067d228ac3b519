"""The cells of one attention KV stream, kept apart from the K/V tensors they describe (llama.cpp's
``llama_kv_cells``).

A cell is one K row and one V row of every attention layer. ``pos[i]`` is the position of the token stored
there (-1: empty) and ``seqs[i]`` the sequences that see it: a cell copied with ``seq_cp`` is shared, not
duplicated. ``shift[i]`` accumulates the position changes of ``seq_add`` / ``seq_div`` since the keys were
last re-rotated (the K-shift a RoPE model applies before its next step).

``seq_pos[s]`` lists the positions of sequence ``s``, sorted, one entry per cell (a position can occur
twice), so ``seq_pos_min`` / ``seq_pos_max`` are O(1). The invariant kept by every method: ``p`` occurs in
``seq_pos[s]`` as often as there are non-empty cells with ``pos == p`` and ``s in seqs``. ``bits[i]`` is
``seqs[i]`` as a bit mask (bit ``s`` for sequence ``s``), from which attention masks are built as tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

CellRecord = tuple[int, frozenset[int], int]  # pos, seqs, shift of one cell (see snapshot / restore)


@dataclass(slots=True)
class SlotInfo:
    """Where one micro-batch's tokens go: ``groups[g] = (stream, cells)``, one group per stream it
    touches; the group's tokens are ``[g * len(cells), (g + 1) * len(cells))`` of the micro-batch."""

    groups: list[tuple[int, list[int]]]

    @property
    def n_per_group(self) -> int:
        return len(self.groups[0][1]) if self.groups else 0


@dataclass(slots=True)
class KVCells:
    """Metadata of ``size`` cells of one stream."""

    size: int
    pos: list[int] = field(default_factory=list)
    seqs: list[set[int]] = field(default_factory=list)
    shift: list[int] = field(default_factory=list)
    bits: list[int] = field(default_factory=list)
    seq_pos: dict[int, list[int]] = field(default_factory=dict)
    n_used: int = 0
    hi: int = field(default=0, compare=False)  # no used cell at or past it (used_max_p1 scans down from it)

    def __post_init__(self) -> None:
        if not self.pos:
            self.reset()

    def reset(self) -> None:
        self.pos = [-1] * self.size
        self.seqs = [set() for _ in range(self.size)]
        self.shift = [0] * self.size
        self.bits = [0] * self.size
        self.seq_pos = {}
        self.n_used = 0
        self.hi = 0

    def copy(self) -> KVCells:
        return KVCells(
            size=self.size,
            pos=list(self.pos),
            seqs=[set(s) for s in self.seqs],
            shift=list(self.shift),
            bits=list(self.bits),
            seq_pos={s: list(p) for s, p in self.seq_pos.items()},
            n_used=self.n_used,
            hi=self.hi,
        )

    # ------------------------------------------------------------- queries

    def is_empty(self, i: int) -> bool:
        return self.pos[i] < 0

    def used_max_p1(self) -> int:
        """One past the last non-empty cell (0 when all are empty): the cells attention must read. Scans
        down from :attr:`hi` (kept by :meth:`occupy`), not from the end of a mostly empty stream."""
        for i in range(self.hi - 1, -1, -1):
            if self.pos[i] >= 0:
                self.hi = i + 1
                return self.hi
        self.hi = 0
        return 0

    def seq_pos_min(self, seq: int) -> int:
        p = self.seq_pos.get(seq)
        return p[0] if p else -1

    def seq_pos_max(self, seq: int) -> int:
        p = self.seq_pos.get(seq)
        return p[-1] if p else -1

    def has_shift(self) -> bool:
        return any(self.shift)

    def cells_of(self, seq: int) -> list[int]:
        """Cells holding ``seq``, in cell order."""
        return [i for i in range(self.size) if seq in self.seqs[i]]

    # -------------------------------------------------------- bookkeeping

    def _index(self, seq: int, p: int) -> None:
        bisect.insort(self.seq_pos.setdefault(seq, []), p)

    def _unindex(self, seq: int, p: int) -> None:
        lst = self.seq_pos[seq]
        del lst[bisect.bisect_left(lst, p)]
        if not lst:
            del self.seq_pos[seq]

    def occupy(self, i: int, pos: int, seqs: set[int] | frozenset[int]) -> None:
        """Store a token at empty cell ``i`` for ``seqs``."""
        assert self.pos[i] < 0, f"cell {i} is not empty"
        self.pos[i] = pos
        self.seqs[i] = set(seqs)
        self.shift[i] = 0
        self.bits[i] = sum(1 << s for s in seqs)
        self.n_used += 1
        self.hi = max(self.hi, i + 1)
        for s in seqs:
            self._index(s, pos)

    def rm(self, i: int) -> None:
        """Empty a non-empty cell."""
        for s in self.seqs[i]:
            self._unindex(s, self.pos[i])
        self.pos[i] = -1
        self.seqs[i] = set()
        self.shift[i] = 0
        self.bits[i] = 0
        self.n_used -= 1

    def seq_rm(self, i: int, seq: int) -> bool:
        """Remove ``seq`` from cell ``i`` (which holds it); True if the cell became empty."""
        self.seqs[i].discard(seq)
        self.bits[i] &= ~(1 << seq)
        self._unindex(seq, self.pos[i])
        if self.seqs[i]:
            return False
        self.pos[i] = -1
        self.shift[i] = 0
        self.n_used -= 1
        return True

    def seq_add(self, i: int, seq: int) -> None:
        """Let ``seq`` see non-empty cell ``i`` too."""
        if seq not in self.seqs[i]:
            self.seqs[i].add(seq)
            self.bits[i] |= 1 << seq
            self._index(seq, self.pos[i])

    def seq_keep(self, i: int, seq: int) -> bool:
        """Keep only ``seq`` in cell ``i``; True if the cell was emptied (it did not hold ``seq``)."""
        if self.pos[i] < 0:
            return False
        if seq in self.seqs[i]:
            for s in self.seqs[i] - {seq}:
                self._unindex(s, self.pos[i])
            self.seqs[i] = {seq}
            self.bits[i] = 1 << seq
            return False
        self.rm(i)
        return True

    def pos_add(self, i: int, d: int) -> bool:
        """Move cell ``i``'s position by ``d`` for every sequence on it; a position below 0 empties the
        cell (True)."""
        for s in self.seqs[i]:
            self._unindex(s, self.pos[i])
        self.pos[i] += d
        self.shift[i] += d
        if self.pos[i] < 0:
            self.pos[i] = -1
            self.seqs[i] = set()
            self.shift[i] = 0
            self.bits[i] = 0
            self.n_used -= 1
            return True
        for s in self.seqs[i]:
            self._index(s, self.pos[i])
        return False

    def pos_div(self, i: int, d: int) -> None:
        """Divide cell ``i``'s position by ``d`` (integer division) for every sequence on it."""
        old = self.pos[i]
        for s in self.seqs[i]:
            self._unindex(s, old)
        self.pos[i] = old // d
        self.shift[i] += self.pos[i] - old
        for s in self.seqs[i]:
            self._index(s, self.pos[i])

    def reset_shift(self) -> None:
        self.shift = [0] * self.size

    # ----------------------------------------------------- dry-run support

    def snapshot(self, idxs: list[int]) -> list[CellRecord]:
        """The cells ``idxs`` as they are, for :meth:`restore`."""
        return [(self.pos[i], frozenset(self.seqs[i]), self.shift[i]) for i in idxs]

    def restore(self, idxs: list[int], records: list[CellRecord]) -> None:
        """Put back cells saved by :meth:`snapshot` (in reverse order of the changes made since)."""
        for i, (pos, seqs, shift) in zip(idxs, records, strict=True):
            if self.pos[i] >= 0:
                self.rm(i)
            if pos >= 0:
                self.occupy(i, pos, seqs)
                self.shift[i] = shift

    # ------------------------------------------------------------ checks

    def check(self) -> None:
        """Raise AssertionError if ``seq_pos`` or ``n_used`` disagree with the cells."""
        expected: dict[int, list[int]] = {}
        for i in range(self.size):
            if self.pos[i] < 0:
                assert not self.seqs[i], f"empty cell {i} holds sequences {self.seqs[i]}"
                continue
            for s in self.seqs[i]:
                expected.setdefault(s, []).append(self.pos[i])
        for lst in expected.values():
            lst.sort()
        assert expected == self.seq_pos, f"seq_pos {self.seq_pos} != cells {expected}"
        assert self.n_used == sum(p >= 0 for p in self.pos), "n_used is out of step"
        assert self.bits == [sum(1 << s for s in seqs) for seqs in self.seqs], "bits are out of step"
        assert all(p < 0 for p in self.pos[self.hi :]), "a used cell lies past hi"


def visible(cells: KVCells, n_kv: int, seqs: list[int], pos: list[int], device: torch.device) -> torch.Tensor:
    """``[len(seqs), n_kv]`` bool: the token of sequence ``seqs[t]`` at position ``pos[t]`` may attend to
    cell ``j`` (it holds that sequence at a position not after the token's): llama.cpp's causal KQ mask.
    Membership comes from the cells' bit masks, 64 sequences a word (one word up to sequence 63)."""
    cell_pos = torch.tensor(cells.pos[:n_kv], dtype=torch.long)
    tok_pos = torch.tensor(pos, dtype=torch.long)
    seq_t = torch.tensor(seqs, dtype=torch.long)
    words = max(seqs, default=0) // 64 + 1
    member = torch.zeros(len(seqs), n_kv, dtype=torch.bool)
    for w in range(words):
        mine = seq_t // 64 == w
        if not bool(mine.any()):
            continue
        bits = _word_tensor(cells.bits[:n_kv], w)
        member[mine] = (bits[None, :] >> (seq_t[mine] % 64)[:, None]) & 1 == 1
    return (member & (cell_pos[None, :] >= 0) & (cell_pos[None, :] <= tok_pos[:, None])).to(device)


def _word_tensor(bits: list[int], w: int) -> torch.Tensor:
    """Bits ``64 w .. 64 w + 63`` of each mask as a signed int64 (bit 63 the sign: ``>>`` then keeps it)."""
    if w == 0:
        try:
            return torch.tensor(bits, dtype=torch.long)  # no sequence past 62 in these cells
        except (OverflowError, RuntimeError, ValueError):
            pass
    words = [(b >> (64 * w)) & ((1 << 64) - 1) for b in bits]
    return torch.tensor([x - (1 << 64) if x >= 1 << 63 else x for x in words], dtype=torch.long)
