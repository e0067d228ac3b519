"""The prefix cache of checkpoints, as the engine uses it: where to take them, and restoring the best.

A recurrent state folds every token before it, so a prompt can only continue from a state taken at a
prefix of it. The engine therefore takes checkpoints (copies of a sequence's state, see
``rsmem.memory.checkpoint``) while prompts are prefilled and when requests end, keyed by the tokens
they fold, in one :class:`~rsmem.engine.prefix_cache.PrefixCache` shared by every sequence. A new
request restores the checkpoint of its longest cached prefix into its own sequence and prefills only
the rest.

Where checkpoints are taken (positions are token counts):

- ``len(prompt) - 1``: the whole prompt but its last token, so the same prompt again (a regenerate)
  computes one token;
- where the prompt leaves the cached tree (it diverges from every cached prompt there): the shared
  part, e.g. a system prompt, is kept once for everyone after it;
- the boundaries the caller names (the server: the end of each chat message);
- every ``interval`` tokens of a long prompt (0: off);
- when a request ends: its prompt and generated tokens (what its sequence holds then).

Taking one ends a prefill chunk at that position (a shorter chunk, not a copy of the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rsmem.engine.prefix_cache import PrefixCache
from rsmem.memory import checkpoint
from rsmem.memory.checkpoint import Checkpoint
from rsmem.memory.recurrent import RecurrentMemory


@dataclass(slots=True)
class CheckpointStats:
    taken: int = 0
    restored: int = 0
    restored_tokens: int = 0
    refused: int = 0  # did not fit the budget
    non_finite: int = 0  # not kept: the state held NaN or inf
    by_kind: dict[str, int] = field(default_factory=dict)


class CheckpointCache:
    def __init__(
        self,
        memory: RecurrentMemory,
        budget_bytes: int,
        *,
        interval: int = 0,
        codec: str = "exact",
    ) -> None:
        if interval < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {interval}")
        if codec not in checkpoint.CODECS:
            raise ValueError(f"unknown checkpoint codec {codec!r}: use one of {', '.join(checkpoint.CODECS)}")
        self.memory = memory
        self.tree: PrefixCache[Checkpoint] = PrefixCache(budget_bytes)
        self.interval = interval
        self.codec = codec
        self.stats = CheckpointStats()

    def positions(self, prompt: Sequence[int], start: int, boundaries: Sequence[int] = ()) -> list[int]:
        """Where to checkpoint ``prompt`` after ``start`` tokens are in: sorted token counts."""
        end = len(prompt) - 1
        points = {end, self.tree.divergence(prompt), *boundaries}
        if self.interval:
            points.update(range(self.interval, end, self.interval))
        return sorted(p for p in points if start < p <= end)

    def restore_best(self, prompt: Sequence[int], seq: int, at_least: int) -> int:
        """Restore into ``seq`` the checkpoint of the longest cached proper prefix of ``prompt``, if it
        covers more than ``at_least`` tokens; returns the tokens it covers (0: nothing restored)."""
        found = self.tree.match(prompt, max_len=len(prompt) - 1)
        if found is None or found.n_tokens <= at_least:
            return 0
        checkpoint.restore(self.memory, found.payload, seq)
        self.stats.restored += 1
        self.stats.restored_tokens += found.n_tokens
        return found.n_tokens

    def take(self, tokens: Sequence[int], seq: int, kind: str) -> None:
        """Checkpoint ``seq``'s state as the state after ``tokens``."""
        ckpt = checkpoint.take(self.memory, seq, self.codec)
        if ckpt is None or not tokens:
            return
        if not ckpt.is_finite():  # never serve a broken state to the requests after this one
            self.stats.non_finite += 1
            return
        if self.tree.insert(tokens, ckpt, kind=kind) is None:
            self.stats.refused += 1
            return
        self.stats.taken += 1
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1

    @property
    def nbytes(self) -> int:
        return self.tree.nbytes

    def __len__(self) -> int:
        return len(self.tree)
