"""Validation, auto-fill and splitting of batches (llama.cpp's ``llama_batch_allocr``).

The allocator turns a user :class:`Batch` into a clean, fully specified token list (``init``), then hands
out micro-batches (``split_equal`` / ``split_seq`` / ``split_simple``) until every token is used.
Validation never touches the memory; it only reads each sequence's last position.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from rsmem.batch.batch import Batch, UBatch
from rsmem.errors import InvalidBatchError

T = TypeVar("T")


class SequencePositions(Protocol):
    """What the allocator needs from a memory: the last stored position of a sequence (-1 if empty)."""

    def seq_pos_max(self, seq_id: int) -> int: ...


class BatchAllocator:
    """Checks a batch, fills in what is missing, and splits it into micro-batches.

    Usage mirrors llama.cpp: ``init(batch, ...)`` once, then ``split_reset()`` and repeated ``split_*``
    calls until one returns ``None``; ``n_used == n_tokens`` tells whether the split placed every token.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.pos: list[int] = []
        self.seq_ids: list[tuple[int, ...]] = []
        self.outputs: list[bool] = []
        self._seq_set: list[int] = []  # bit mask of each token's sequences
        self._seq_set_tokens: dict[int, list[int]] = {}  # mask -> token indices in batch order
        self._used: list[bool] = []
        self._cursor: dict[int, int] = {}  # set mask -> index in its tokens of the first maybe unused
        self.n_used = 0

    # ------------------------------------------------------------------ init

    def init(
        self,
        batch: Batch,
        *,
        n_vocab: int,
        n_seq_max: int,
        memory: SequencePositions | None = None,
        output_all: bool = False,
        allow_coupled: bool = False,
    ) -> None:
        """Validate ``batch`` and fill its missing fields; raises :class:`InvalidBatchError`.

        The rules, in llama.cpp's order: at least one token; tokens in ``[0, n_vocab)``; seq ids in
        ``[0, n_seq_max)``; auto-fill; a sequence with state continues at ``seq_pos_max + 1``; positions of
        one sequence step by exactly one. ``allow_coupled=False`` rejects tokens that belong to several
        sequences, which a recurrent memory cannot place (llama.cpp fails such a decode too).
        """
        n = len(batch.tokens)
        if n == 0:
            raise InvalidBatchError("batch has no tokens")
        tokens = list(map(int, batch.tokens))
        if min(tokens) < 0 or max(tokens) >= n_vocab:
            i, tok = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < n_vocab)
            raise InvalidBatchError(f"token {i}: id {tok} is outside the vocabulary [0, {n_vocab})")

        runs = self._checked_runs(batch, n, n_seq_max, allow_coupled)
        seq_ids: list[tuple[int, ...]] = []
        for ids, k in runs:
            seq_ids += [ids] * k
        pos = self._filled_positions(batch, n, runs, memory)
        outputs = self._filled_outputs(batch, n, output_all)
        if batch.pos is not None or any(len(ids) > 1 for ids, _ in runs):
            self._check_positions(pos, seq_ids, memory)
        # else positions were filled from the memory's, one step a token: nothing to check

        self.tokens, self.pos, self.seq_ids, self.outputs = tokens, pos, seq_ids, outputs
        self._seq_set = []
        self._seq_set_tokens = {}
        i = 0
        for ids, k in runs:
            mask = sum(1 << s for s in ids)
            self._seq_set += [mask] * k
            self._seq_set_tokens.setdefault(mask, []).extend(range(i, i + k))
            i += k
        self.split_reset()

    @staticmethod
    def _checked_runs(
        batch: Batch, n: int, n_seq_max: int, allow_coupled: bool
    ) -> list[tuple[tuple[int, ...], int]]:
        """The batch's sequence ids as runs ``(ids, count)`` of consecutive tokens with the same ids
        (each run checked once: a batch of a few prompt chunks and decode tokens has a few runs)."""
        if batch.seq_ids is None:
            return [((0,), n)]
        if len(batch.seq_ids) != n:
            raise InvalidBatchError(f"seq_ids has {len(batch.seq_ids)} entries for {n} tokens")
        runs: list[tuple[tuple[int, ...], int]] = []
        i = 0
        for ids, group in itertools.groupby(map(tuple, batch.seq_ids)):
            k = len(list(group))
            runs.append((BatchAllocator._checked_ids(ids, i, n_seq_max, allow_coupled), k))
            i += k
        return runs

    @staticmethod
    def _checked_ids(ids: tuple[int, ...], i: int, n_seq_max: int, allow_coupled: bool) -> tuple[int, ...]:
        """Token ``i``'s sequence ids, checked."""
        ids_t = tuple(int(s) for s in ids)
        if not ids_t:
            raise InvalidBatchError(f"token {i}: has no sequence id")
        for s in ids_t:
            if not 0 <= s < n_seq_max:
                raise InvalidBatchError(f"token {i}: seq_id {s} is outside [0, {n_seq_max})")
        if len(set(ids_t)) != len(ids_t):
            raise InvalidBatchError(f"token {i}: seq_ids {list(ids_t)} repeat a sequence")
        if len(ids_t) > 1 and not allow_coupled:
            raise InvalidBatchError(
                f"token {i}: belongs to sequences {list(ids_t)}; a recurrent memory cannot couple "
                "sequences in one token (decode each sequence's tokens, or fork with seq_cp)"
            )
        return ids_t

    @staticmethod
    def _filled_positions(
        batch: Batch, n: int, runs: list[tuple[tuple[int, ...], int]], memory: SequencePositions | None
    ) -> list[int]:
        if batch.pos is not None:
            if len(batch.pos) != n:
                raise InvalidBatchError(f"pos has {len(batch.pos)} entries for {n} tokens")
            pos = list(map(int, batch.pos))
            if min(pos) < 0:
                i, p = next((i, p) for i, p in enumerate(pos) if p < 0)
                raise InvalidBatchError(f"token {i}: position {p} is negative")
            return pos
        next_pos: dict[int, int] = {}
        pos = []
        for ids, k in runs:
            first = ids[0]
            if first in next_pos:
                p = next_pos[first]
            else:
                p = memory.seq_pos_max(first) + 1 if memory is not None else 0
            pos.extend(range(p, p + k))
            for s in ids:
                next_pos[s] = p + k
        return pos

    @staticmethod
    def _filled_outputs(batch: Batch, n: int, output_all: bool) -> list[bool]:
        if output_all:
            return [True] * n
        if batch.logits is None:
            return [False] * (n - 1) + [True]
        if len(batch.logits) != n:
            raise InvalidBatchError(f"logits has {len(batch.logits)} entries for {n} tokens")
        return list(map(bool, batch.logits))

    @staticmethod
    def _check_positions(
        pos: list[int], seq_ids: list[tuple[int, ...]], memory: SequencePositions | None
    ) -> None:
        last: dict[int, int] = {}
        for i, ids in enumerate(seq_ids):
            for s in ids:
                prev = last.get(s)
                if prev is None:
                    stored = memory.seq_pos_max(s) if memory is not None else -1
                    if stored >= 0 and pos[i] != stored + 1:
                        raise InvalidBatchError(
                            f"token {i}: sequence {s} starts at position {pos[i]}, but the memory holds "
                            f"it up to X = {stored}; positions must remain consecutive: Y = X + 1 = "
                            f"{stored + 1}"
                        )
                elif pos[i] != prev + 1:
                    raise InvalidBatchError(
                        f"token {i}: position {pos[i]} of sequence {s} does not follow {prev}; positions "
                        "of one sequence must step by exactly one"
                    )
                last[s] = pos[i]

    # ---------------------------------------------------------------- queries

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_outputs(self) -> int:
        return sum(self.outputs)

    # ---------------------------------------------------------------- splits

    def split_reset(self) -> None:
        """Mark every token unused, so the splits start over."""
        self._used = [False] * len(self.tokens)
        self._cursor = {}
        self.n_used = 0

    def split_simple(self, n_ubatch: int) -> UBatch | None:
        """Up to ``n_ubatch`` unused tokens in batch order (attention caches only; not equal-seq)."""
        idxs = [i for i, u in enumerate(self._used) if not u][:n_ubatch]
        if not idxs:
            return None
        return self._take(idxs, n_seqs=len(idxs), equal_seqs=False)

    def split_seq(self, n_ubatch: int) -> UBatch | None:
        """Tokens of one sequence set: the first unused token's set, then tokens whose set is a subset."""
        first = next((i for i, u in enumerate(self._used) if not u), None)
        if first is None:
            return None
        cur = self._seq_set[first]
        idxs = [first]
        for i in range(first + 1, len(self.tokens)):
            if len(idxs) >= n_ubatch:
                break
            mask = self._seq_set[i]
            if not self._used[i] and (cur & mask) == mask:
                idxs.append(i)
                cur = mask
        return self._take(idxs, n_seqs=1, equal_seqs=True)

    def split_equal(
        self, n_ubatch: int, sequential: bool = False, tail_apart: int = 0, min_before_tail: int = 1
    ) -> UBatch | None:
        """The same number of tokens from each of several disjoint sequence sets.

        Sets join in order of their first unused token; with ``sequential`` only consecutive primary
        seq ids may join (llama.cpp's setting for unified caches). Each set contributes tokens in order;
        at most ``n_ubatch`` tokens and ``n_ubatch`` sets are taken. With ``tail_apart = K``, the last K
        tokens of a set that has at least ``min_before_tail`` tokens before them in the batch never share
        a micro-batch with those, so one ends K tokens before the set's last (where the memory's rollback
        takes a snapshot); shorter sets are not split.
        """
        if n_ubatch < 1:
            raise ValueError(f"n_ubatch must be at least 1, got {n_ubatch}")
        sets = self._sequential_sets(n_ubatch) if sequential else self._first_sets(n_ubatch)
        if not sets:
            return None
        pending = [self._unused_of(m) for m in sets]
        caps = [
            len(p) - tail_apart
            if len(p) > tail_apart and len(self._seq_set_tokens[m]) - tail_apart >= min_before_tail
            else len(p)
            for m, p in zip(sets, pending)
        ]
        n_per_set = min(min(caps), max(1, n_ubatch // len(sets)))
        idxs = [i for p in pending for i in p[:n_per_set]]
        return self._take(idxs, n_seqs=len(sets), equal_seqs=True)

    def _first_sets(self, n_ubatch: int) -> list[int]:
        """Disjoint sequence sets with unused tokens, in order of their first unused token (at most
        ``n_ubatch``)."""
        firsts = sorted((p[0], m) for m in self._seq_set_tokens if (p := self._unused_of(m)))
        sets: list[int] = []
        union = 0
        for _, mask in firsts:
            if union & mask:
                continue
            sets.append(mask)
            union |= mask
            if len(sets) >= n_ubatch:
                break
        return sets

    def _sequential_sets(self, n_ubatch: int) -> list[int]:
        """:meth:`_first_sets` where only consecutive primary seq ids may join, token by token."""
        sets: list[int] = []
        union = 0
        last_seq = -1
        for i, used in enumerate(self._used):
            if used:
                continue
            mask = self._seq_set[i]
            if union & mask:
                continue
            if sets and self.seq_ids[i][0] != last_seq + 1:
                continue
            sets.append(mask)
            union |= mask
            last_seq = self.seq_ids[i][0]
            if len(sets) >= n_ubatch:
                break
        return sets

    def _unused_of(self, mask: int) -> list[int]:
        """The unused tokens of sequence set ``mask``, in batch order. Every split takes a set's tokens in
        batch order, so they are the tail of its tokens after the first unused one (found by a cursor
        that only moves forward until :meth:`split_reset`)."""
        toks = self._seq_set_tokens[mask]
        k = self._cursor.get(mask, 0)
        used = self._used
        while k < len(toks) and used[toks[k]]:
            k += 1
        self._cursor[mask] = k
        return toks[k:]

    @staticmethod
    def ubatch_reserve(n_seq_tokens: int, n_seqs: int, *, seq_id: int = 0, pos: Sequence[int] = ()) -> UBatch:
        """An empty-token micro-batch of a given shape, used to place restored state."""
        n = n_seq_tokens * n_seqs
        positions = tuple(pos) if pos else (0,) * n
        return UBatch(
            tokens=(0,) * n,
            pos=positions,
            seq_ids=((seq_id,),) * n,
            outputs=(False,) * n,
            batch_index=tuple(range(n)),
            n_seqs=n_seqs,
            n_seq_tokens=n_seq_tokens,
            equal_seqs=True,
        )

    def _take(self, idxs: list[int], *, n_seqs: int, equal_seqs: bool) -> UBatch:
        used = self._used
        for i in idxs:
            used[i] = True
        self.n_used += len(idxs)
        pick = _picker(idxs)
        return UBatch(
            tokens=pick(self.tokens),
            pos=pick(self.pos),
            seq_ids=pick(self.seq_ids),
            outputs=pick(self.outputs),
            batch_index=tuple(idxs),
            n_seqs=n_seqs,
            n_seq_tokens=len(idxs) // n_seqs,
            equal_seqs=equal_seqs,
        )


def _picker(idxs: list[int]) -> Callable[[list[T]], tuple[T, ...]]:
    """A function taking the items at ``idxs`` of a list, as a tuple (a slice when they are consecutive)."""
    a, b = (idxs[0], idxs[-1] + 1) if idxs else (0, 0)
    if idxs == list(range(a, b)):
        return lambda xs: tuple(xs[a:b])
    return lambda xs: tuple(xs[i] for i in idxs)
