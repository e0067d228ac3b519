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

With a ``cache_dir`` (``--cache-dir``) every checkpoint kept is also written there, one file each
(:mod:`rsmem.engine.cache_dir`), and a restart finds them: the longest prefix is looked up in RAM and on
disk, and a disk entry's rows are read only when it is the one restored (it then joins the RAM cache).
Saved slots and sessions carry the checkpoints along their tokens (:meth:`CheckpointCache.along`, written
by :mod:`rsmem.engine.kept`), and restoring them adds those back (:meth:`CheckpointCache.add`).

A hybrid model's checkpoints (recurrent rows and the KV prefix, see :mod:`rsmem.memory.checkpoint`) go to
the cache dir with their KV rows (version 2 files, :mod:`rsmem.memory.checkpoint_kv`), and so do the
companions of a hybrid's saved slots and sessions; checkpoints without KV rows are refused (:meth:`add`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rsmem.context import Context
from rsmem.engine.cache_dir import DiskCache
from rsmem.engine.prefix_cache import PrefixCache
from rsmem.errors import NoSlotError
from rsmem.memory import checkpoint
from rsmem.memory import checkpoint_file as cf
from rsmem.memory.checkpoint import Checkpoint
from rsmem.memory.hybrid import HybridMemory
from rsmem.memory.protocol import SequenceMemory
from rsmem.memory.recurrent import RecurrentMemory

DEFAULT_DISK_BYTES = 4 << 30
log = logging.getLogger("rsmem.checkpoints")


def _layout(memory: SequenceMemory) -> cf.Layout:
    """The layout of the memory's checkpoints (a hybrid's: recurrent rows and KV layers)."""
    if not isinstance(memory, (RecurrentMemory, HybridMemory)):
        raise TypeError(f"a prefix cache over a {type(memory).__name__} is not supported")
    return cf.Layout.of(memory)


@dataclass(slots=True)
class CheckpointStats:
    taken: int = 0
    restored: int = 0
    restored_tokens: int = 0
    refused: int = 0  # did not fit the budget
    non_finite: int = 0  # not kept: the state held NaN or inf
    disk_restores: int = 0  # restores read from the cache dir
    added: int = 0  # checkpoints added from saved slots and sessions
    by_kind: dict[str, int] = field(default_factory=dict)


class CheckpointCache:
    def __init__(
        self,
        memory: SequenceMemory,
        budget_bytes: int,
        *,
        interval: int = 0,
        codec: str = "exact",
        fingerprint: bytes = bytes(cf.DIGEST_BYTES),
        cache_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = DEFAULT_DISK_BYTES,
    ) -> None:
        """``fingerprint``: the model's (:func:`~rsmem.memory.checkpoint_file.model_fingerprint`), written
        into checkpoint files and required of those read; ``cache_dir``: keep checkpoints there too, under
        ``disk_bytes`` of files."""
        if interval < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {interval}")
        if codec not in checkpoint.CODECS:
            raise ValueError(f"unknown checkpoint codec {codec!r}: use one of {', '.join(checkpoint.CODECS)}")
        self.memory = memory
        self.tree: PrefixCache[Checkpoint] = PrefixCache(budget_bytes)
        self.interval = interval
        self.codec = codec
        self.stats = CheckpointStats()
        self.layout = _layout(memory)
        self.fingerprint = fingerprint
        self.hybrid = isinstance(memory, HybridMemory)  # checkpoints with KV rows
        self.disk = None if cache_dir is None else DiskCache(cache_dir, self.layout, fingerprint, disk_bytes)

    @classmethod
    def for_context(
        cls,
        context: Context,
        budget_bytes: int,
        *,
        interval: int = 0,
        codec: str = "exact",
        cache_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = DEFAULT_DISK_BYTES,
    ) -> CheckpointCache:
        """A cache over ``context``'s memory, fingerprinted with its model."""
        fingerprint = cf.model_fingerprint(context.model, _layout(context.memory))
        return cls(
            context.memory,
            budget_bytes,
            interval=interval,
            codec=codec,
            fingerprint=fingerprint,
            cache_dir=cache_dir,
            disk_bytes=disk_bytes,
        )

    def positions(self, prompt: Sequence[int], start: int, boundaries: Sequence[int] = ()) -> list[int]:
        """Where to checkpoint ``prompt`` after ``start`` tokens are in: sorted token counts."""
        end = len(prompt) - 1
        points = {end, self.tree.divergence(prompt), *boundaries}
        if self.disk is not None:
            points.add(self.disk.tree.divergence(prompt))
        if self.interval:
            points.update(range(self.interval, end, self.interval))
        return sorted(p for p in points if start < p <= end)

    def covered(self, prompt: Sequence[int]) -> int:
        """The tokens the longest cached proper prefix of ``prompt`` covers (in RAM or in the cache dir):
        what :meth:`restore_best` would restore now. Looks only (no hit counted, nothing read)."""
        limit = len(prompt) - 1
        found = self.tree.match(prompt, max_len=limit, touch=False)
        on_disk = None if self.disk is None else self.disk.match(prompt, limit)
        return max(0 if found is None else found.n_tokens, 0 if on_disk is None else on_disk.n_tokens)

    def restore_best(
        self,
        prompt: Sequence[int],
        seq: int,
        at_least: int,
        room: Callable[[Checkpoint], bool] | None = None,
    ) -> int:
        """Restore into ``seq`` the checkpoint of the longest cached proper prefix of ``prompt`` (in RAM
        or in the cache dir), if it covers more than ``at_least`` tokens; returns the tokens it covers
        (0: nothing restored).

        ``room(checkpoint)`` makes room for the checkpoint in ``seq`` (cells that cached states held) and
        says whether it fits. A checkpoint that finds no cells is not restored (0: the prompt is
        prefilled, and ``seq`` is as it was)."""
        limit = len(prompt) - 1
        found = self.tree.match(prompt, max_len=limit, touch=False)
        in_ram = 0 if found is None else found.n_tokens
        from_disk = self._from_disk(prompt, limit, max(in_ram, at_least))
        if from_disk is not None:
            n, ckpt = from_disk
        else:
            self.tree.match(prompt, max_len=limit)  # counts the hit or the miss
            if found is None or in_ram <= at_least:
                return 0
            n, ckpt = in_ram, found.payload
        if room is not None and not room(ckpt):
            return 0
        try:
            checkpoint.restore(self.memory, ckpt, seq)
        except NoSlotError:  # the memory is unchanged
            return 0
        self.stats.disk_restores += from_disk is not None
        self.stats.restored += 1
        self.stats.restored_tokens += n
        return n

    def _from_disk(self, prompt: Sequence[int], limit: int, beat: int) -> tuple[int, Checkpoint] | None:
        """The longest disk entry along ``prompt`` covering more than ``beat`` tokens, read (a file that
        fails is dropped and the next one tried); it joins the RAM cache."""
        while self.disk is not None:
            found = self.disk.match(prompt, limit)
            if found is None or found.n_tokens <= beat:
                return None
            key = list(prompt[: found.n_tokens])
            ckpt = self.disk.load(key)
            if ckpt is not None:
                self._keep(key, ckpt, "disk")
                return found.n_tokens, ckpt
        return None

    def take(self, tokens: Sequence[int], seq: int, kind: str) -> None:
        """Checkpoint ``seq``'s state as the state after ``tokens``."""
        ckpt = checkpoint.take(self.memory, seq, self.codec)
        if ckpt is not None and tokens:
            self.put(tokens, ckpt, kind)

    def put(self, tokens: Sequence[int], ckpt: Checkpoint, kind: str) -> None:
        """Keep a checkpoint taken just now (e.g. captured inside a decode) as the state after ``tokens``."""
        if self.add(tokens, ckpt, kind):
            self.stats.taken += 1
            self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1

    def add(self, tokens: Sequence[int], ckpt: Checkpoint, kind: str) -> bool:
        """Keep ``ckpt`` as the state after ``tokens`` (in RAM, and in the cache dir when there is one);
        False when it is not finite or fits neither."""
        if not ckpt.is_finite():  # never serve a broken state to the requests after this one
            self.stats.non_finite += 1
            return False
        if self.hybrid and ckpt.kv is None:  # e.g. read from a companion file: no KV rows to restore
            return False
        kept = self._keep(tokens, ckpt, kind)
        if self.disk is not None:
            kept = self.disk.put(tokens, ckpt) or kept
        return kept

    def _keep(self, tokens: Sequence[int], ckpt: Checkpoint, kind: str) -> bool:
        if self.tree.insert(tokens, ckpt, kind=kind) is None:
            self.stats.refused += 1
            return False
        return True

    def along(self, tokens: Sequence[int]) -> list[tuple[int, Checkpoint]]:
        """Every checkpoint kept (RAM, then the cache dir) whose tokens are a prefix of ``tokens``, as
        (n_tokens, checkpoint), shortest first."""
        found: dict[int, Checkpoint] = {}
        for n in self.tree.along(tokens):
            match = self.tree.match(tokens, max_len=n, touch=False)
            if match is not None and match.n_tokens == n:
                found[n] = match.payload
        if self.disk is not None:
            for n in self.disk.keys_along(tokens):
                if n not in found and (ckpt := self.disk.load(list(tokens[:n]))) is not None:
                    found[n] = ckpt
        return sorted(found.items(), key=lambda item: item[0])

    @property
    def nbytes(self) -> int:
        return self.tree.nbytes

    def __len__(self) -> int:
        return len(self.tree)
