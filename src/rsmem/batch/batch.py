"""The user-facing batch (llama.cpp's ``llama_batch``) and the micro-batch the memory and model see."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Batch:
    """Tokens to decode, with optional positions, sequence ids and output flags.

    Missing fields are filled in by :class:`~rsmem.batch.allocator.BatchAllocator`: ``seq_ids`` default to
    sequence 0, ``pos`` continue each sequence from what the memory holds, and ``logits`` default to an
    output for the last token only. ``seq_ids`` is a list of sequence-id lists, one list per token.
    """

    tokens: Sequence[int]
    pos: Sequence[int] | None = None
    seq_ids: Sequence[Sequence[int]] | None = None
    logits: Sequence[bool] | None = None

    @classmethod
    def from_sequences(
        cls,
        tokens_by_seq: dict[int, Sequence[int]],
        *,
        start_pos: dict[int, int] | None = None,
        all_logits: bool = False,
    ) -> Batch:
        """One batch holding several sequences' tokens, each sequence's last token marked for output.

        ``start_pos`` gives explicit first positions; without it positions are left to auto-fill.
        """
        tokens: list[int] = []
        seq_ids: list[list[int]] = []
        logits: list[bool] = []
        pos: list[int] = []
        for seq, seq_tokens in tokens_by_seq.items():
            n = len(seq_tokens)
            tokens.extend(seq_tokens)
            seq_ids.extend([seq] for _ in range(n))
            logits.extend(all_logits or k == n - 1 for k in range(n))
            if start_pos is not None:
                pos.extend(range(start_pos[seq], start_pos[seq] + n))
        return cls(tokens, pos if start_pos is not None else None, seq_ids, logits)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(slots=True, frozen=True)
class UBatch:
    """A micro-batch: the unit one model forward processes (llama.cpp's ``llama_ubatch``).

    Tokens are grouped per sequence set: set ``s`` owns tokens ``[s*n_seq_tokens, (s+1)*n_seq_tokens)``.
    With ``equal_seqs`` every set has the same number of tokens, which the recurrent memory requires.
    ``batch_index[i]`` is the index in the parent batch of token ``i`` (how outputs find their place).
    """

    tokens: tuple[int, ...]
    pos: tuple[int, ...]
    seq_ids: tuple[tuple[int, ...], ...]
    outputs: tuple[bool, ...]
    batch_index: tuple[int, ...]
    n_seqs: int
    n_seq_tokens: int
    equal_seqs: bool
    _token_tensor: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def of_sequence(cls, seq_id: int, tokens: Sequence[int], first_pos: int) -> UBatch:
        """One sequence's tokens at ``first_pos, first_pos + 1, ...``, with no outputs (a replay)."""
        n = len(tokens)
        return cls(
            tokens=tuple(tokens),
            pos=tuple(range(first_pos, first_pos + n)),
            seq_ids=((seq_id,),) * n,
            outputs=(False,) * n,
            batch_index=tuple(range(n)),
            n_seqs=1,
            n_seq_tokens=n,
            equal_seqs=True,
        )

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_outputs(self) -> int:
        return sum(self.outputs)

    def seq_set(self, s: int) -> tuple[int, ...]:
        """The sequence ids of sequence set ``s`` (the first is the one whose cell holds the state)."""
        return self.seq_ids[s * self.n_seq_tokens]

    @property
    def primary_seq_ids(self) -> list[int]:
        """The first sequence id of each sequence set, in ubatch order."""
        return [self.seq_ids[s * self.n_seq_tokens][0] for s in range(self.n_seqs)]

    def last_pos(self, s: int) -> int:
        """Position of the last token of sequence set ``s``."""
        return self.pos[(s + 1) * self.n_seq_tokens - 1]

    def token_tensor(self) -> torch.Tensor:
        """Token ids as a ``[n_seqs, n_seq_tokens]`` int64 tensor (built once, then cached)."""
        if not self._token_tensor:
            t = torch.tensor(self.tokens, dtype=torch.long).view(self.n_seqs, self.n_seq_tokens)
            self._token_tensor.append(t)
        return self._token_tensor[0]

    def output_rows(self) -> list[int]:
        """Indices (in ubatch order) of the tokens whose logits are wanted."""
        return [i for i, out in enumerate(self.outputs) if out]
