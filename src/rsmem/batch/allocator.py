"""Validation, auto-fill and splitting of batches (llama.cpp's ``llama_batch_allocr``).

The allocator turns a user :class:`Batch` into a clean, fully specified token list (``init``), then hands
out micro-batches (``split_equal`` / ``split_seq`` / ``split_simple``) until every token is used.
Validation never touches the memory; it only reads each sequence's last position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rsmem.batch.batch import Batch, UBatch
from rsmem.errors import InvalidBatchError


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
        tokens = [int(t) for t in batch.tokens]
        for i, tok in enumerate(tokens):
            if not 0 <= tok < n_vocab:
                raise InvalidBatchError(f"token {i}: id {tok} is outside the vocabulary [0, {n_vocab})")

        seq_ids = self._checked_seq_ids(batch, n, n_seq_max, allow_coupled)
        pos = self._filled_positions(batch, n, seq_ids, memory)
        outputs = self._filled_outputs(batch, n, output_all)
        self._check_positions(pos, seq_ids, memory)

        self.tokens, self.pos, self.seq_ids, self.outputs = tokens, pos, seq_ids, outputs
        self._seq_set = [sum(1 << s for s in ids) for ids in seq_ids]
        self._seq_set_tokens = {}
        for i, mask in enumerate(self._seq_set):
            self._seq_set_tokens.setdefault(mask, []).append(i)
        self.split_reset()

    @staticmethod
    def _checked_seq_ids(batch: Batch, n: int, n_seq_max: int, allow_coupled: bool) -> list[tuple[int, ...]]:
        if batch.seq_ids is None:
            return [(0,)] * n
        if len(batch.seq_ids) != n:
            raise InvalidBatchError(f"seq_ids has {len(batch.seq_ids)} entries for {n} tokens")
        out: list[tuple[int, ...]] = []
        for i, ids in enumerate(batch.seq_ids):
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
            out.append(ids_t)
        return out

    @staticmethod
    def _filled_positions(
        batch: Batch, n: int, seq_ids: list[tuple[int, ...]], memory: SequencePositions | None
    ) -> list[int]:
        if batch.pos is not None:
            if len(batch.pos) != n:
                raise InvalidBatchError(f"pos has {len(batch.pos)} entries for {n} tokens")
            pos = [int(p) for p in batch.pos]
            for i, p in enumerate(pos):
                if p < 0:
                    raise InvalidBatchError(f"token {i}: position {p} is negative")
            return pos
        next_pos: dict[int, int] = {}
        pos = []
        for ids in seq_ids:
            first = ids[0]
            if first not in next_pos:
                next_pos[first] = memory.seq_pos_max(first) + 1 if memory is not None else 0
            p = next_pos[first]
            pos.append(p)
            for s in ids:
                next_pos[s] = p + 1
        return pos

    @staticmethod
    def _filled_outputs(batch: Batch, n: int, output_all: bool) -> list[bool]:
        if output_all:
            return [True] * n
        if batch.logits is None:
            return [False] * (n - 1) + [True]
        if len(batch.logits) != n:
            raise InvalidBatchError(f"logits has {len(batch.logits)} entries for {n} tokens")
        return [bool(x) for x in batch.logits]

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
        sets: list[int] = []
        union = 0
        last_seq = -1
        for i, used in enumerate(self._used):
            if used:
                continue
            mask = self._seq_set[i]
            if union & mask:
                continue
            if sequential and sets and self.seq_ids[i][0] != last_seq + 1:
                continue
            sets.append(mask)
            union |= mask
            last_seq = self.seq_ids[i][0]
            if len(sets) >= n_ubatch:
                break
        if not sets:
            return None
        pending = [[i for i in self._seq_set_tokens[m] if not self._used[i]] for m in sets]
        caps = [
            len(p) - tail_apart
            if len(p) > tail_apart and len(self._seq_set_tokens[m]) - tail_apart >= min_before_tail
            else len(p)
            for m, p in zip(sets, pending)
        ]
        n_per_set = min(min(caps), max(1, n_ubatch // len(sets)))
        idxs = [i for p in pending for i in p[:n_per_set]]
        return self._take(idxs, n_seqs=len(sets), equal_seqs=True)

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
        for i in idxs:
            self._used[i] = True
        self.n_used += len(idxs)
        return UBatch(
            tokens=tuple(self.tokens[i] for i in idxs),
            pos=tuple(self.pos[i] for i in idxs),
            seq_ids=tuple(self.seq_ids[i] for i in idxs),
            outputs=tuple(self.outputs[i] for i in idxs),
            batch_index=tuple(idxs),
            n_seqs=n_seqs,
            n_seq_tokens=len(idxs) // n_seqs,
            equal_seqs=equal_seqs,
        )
