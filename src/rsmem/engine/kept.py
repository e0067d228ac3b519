"""What outlives a request: sessions (a conversation's sequence, kept between requests) and slots'
cached states, saved to and restored from llama.cpp sequence files.

With the prefix cache on, a saved sequence keeps its checkpoints: next to ``NAME`` (the ``.ggsq``, exactly
as llama.cpp writes it) goes ``NAME.ckpt``, a companion in :mod:`rsmem.memory.checkpoint_file`'s format
holding every cached checkpoint whose tokens are a proper prefix of the file's tokens (none: no companion,
and a stale one is removed). Restoring adds them, and the restored state itself, to the prefix cache, so
a later prompt that leaves the saved history early (a regenerate, an answer tokenised differently) still
starts from a checkpoint. A missing companion is fine (plain llama.cpp files); one that does not parse,
or belongs to other tokens, another model or memory, is skipped with a warning and nothing of it is
used; the sequence file is restored all the same.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from rsmem.batch.batch import Batch
from rsmem.context import Context
from rsmem.engine.checkpoints import CheckpointCache
from rsmem.engine.pool import SequencePool
from rsmem.engine.request import Session
from rsmem.engine.reuse import PromptReuse
from rsmem.errors import InvalidRequestError, NoFreeSequenceError, NoSlotError, StateFormatError
from rsmem.memory import checkpoint_file as cf
from rsmem.memory.checkpoint import Checkpoint
from rsmem.memory.state_io import atomic_write

log = logging.getLogger("rsmem.kept")
COMPANION_SUFFIX = ".ckpt"


def companion_path(path: str | os.PathLike[str]) -> Path:
    """Where the checkpoints of the sequence file ``path`` go."""
    return Path(os.fspath(path) + COMPANION_SUFFIX)


class KeptSequences:
    def __init__(
        self,
        context: Context,
        pool: SequencePool,
        checkpoints: CheckpointCache | None = None,
        reuse: PromptReuse | None = None,
    ) -> None:
        """``reuse``: where KV cells are shared, it clears idle slots' cached states to make room."""
        self.ctx = context
        self.pool = pool
        self.checkpoints = checkpoints
        self.reuse = reuse

    # ------------------------------------------------------------ sessions

    def open_session(self, path: str | None = None) -> Session:
        if not self.pool.n_free:
            n_held = len(self.pool.held)
            raise NoFreeSequenceError(
                f"no free sequence for a session: sessions hold {n_held} of the {self.pool.n_seq}, "
                f"requests run in the other {self.pool.n_seq - n_held} (close a session, or make the "
                "context with more sequences: n_seq_max / --parallel)"
            )
        seq = self.pool.best_free([])
        self.pool.take(seq, [])
        try:
            tokens = self._load_file(path, seq) if path is not None else []
        except BaseException:
            self.pool.release(seq, None)
            raise
        session = Session(seq, tokens=tokens)
        self.pool.hold(seq, session)
        if path is not None:
            self._load_checkpoints(path, tokens, seq)
        return session

    def save_session(self, session: Session, path: str) -> int:
        """A pending token (sampled, not yet in the state) is decoded first so the file is complete."""
        if session.busy:
            raise RuntimeError("the session has a request running; save it when the request is done")
        if session.closed:
            raise RuntimeError("the session is closed")
        while session.pending:  # in pieces of n_batch: a prompt interrupted early leaves a long tail
            piece = session.pending[: self.ctx.n_batch]
            if self.reuse is not None:
                self.reuse.make_room(len(piece))
            self.ctx.decode(Batch(piece, seq_ids=[[session.seq_id]] * len(piece)))
            session.tokens += piece
            del session.pending[: len(piece)]
        n_bytes = self.ctx.state_seq_save_file(path, session.seq_id, session.tokens)
        self._save_checkpoints(path, session.tokens)
        return n_bytes

    def close_session(self, session: Session) -> None:
        if session.busy:
            raise RuntimeError("the session has a request running")
        if not session.closed:
            self.pool.unhold(session.seq_id)
            session.closed = True

    # --------------------------------------------------------------- slots

    def _idle_slot(self, slot: int) -> None:
        n = self.pool.n_seq
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < n:
            raise InvalidRequestError("slot", f"{slot!r} does not exist: slots are 0 to {n - 1}")
        if not self.pool.is_free(slot):
            raise RuntimeError(f"slot {slot} is busy")

    def slot_save(self, slot: int, path: str) -> tuple[int, int]:
        self._idle_slot(slot)
        tokens = self.pool.cached_tokens(slot)
        n_bytes = self.ctx.state_seq_save_file(path, slot, tokens)
        self._save_checkpoints(path, tokens)
        return len(tokens), n_bytes

    def slot_restore(self, slot: int, path: str) -> int:
        """A prompt extending the file's tokens continues from its state. A file that does not load
        (truncated, corrupt, non-finite) leaves the slot as it was."""
        self._idle_slot(slot)
        tokens = self._load_file(path, slot)
        self.pool.set_cached(slot, tokens if tokens or self.ctx.memory.seq_pos_max(slot) >= 0 else None)
        self._load_checkpoints(path, tokens, slot)
        return len(tokens)

    def slot_erase(self, slot: int) -> int:
        self._idle_slot(slot)
        return self.pool.erase(slot)

    def _load_file(self, path: str, seq: int) -> list[int]:
        """Load a sequence file into ``seq``; returns its tokens. Where KV cells are shared, idle slots'
        cached states give way (the one cached longest ago first) until the file's cells fit."""
        loaded: list[list[int]] = []

        def fits() -> bool:
            try:
                loaded.append(self.ctx.state_seq_load_file(path, seq))
            except NoSlotError:
                if self.reuse is None or not self.reuse.shares_cells:
                    raise
                return False
            return True

        if not self.pool.evict_until(fits):
            raise NoSlotError(
                f"no free KV cells to restore {Path(path).name} into sequence {seq}, even with every idle "
                "slot's cached state cleared: the running requests and sessions hold them"
            )
        return loaded[0]

    # --------------------------------------------------------- checkpoints

    def _save_checkpoints(self, path: str | os.PathLike[str], tokens: Sequence[int]) -> int:
        """Write the companion of the sequence file ``path`` (just written); returns the checkpoints in it.
        A companion that cannot be written is a warning: the sequence file is saved."""
        cache, target = self.checkpoints, companion_path(path)
        records = [] if cache is None else [(n, c) for n, c in cache.along(tokens) if n < len(tokens)]
        try:
            if not records:
                target.unlink(missing_ok=True)
                return 0
            assert cache is not None
            atomic_write(target, cf.companion_bytes(cache.layout, cache.fingerprint, tokens, records))
        except OSError as exc:
            log.warning("checkpoints of %s not saved: %s", Path(path).name, exc)
            return 0
        return len(records)

    def _load_checkpoints(self, path: str | os.PathLike[str], tokens: Sequence[int], seq: int) -> int:
        """Add the companion's checkpoints and ``seq``'s restored state to the prefix cache (when it is
        on); returns the checkpoints added from the companion. All or none of a companion is used."""
        cache, source = self.checkpoints, companion_path(path)
        if cache is None:
            return 0
        records: list[tuple[int, Checkpoint]] = []
        if source.is_file():
            try:
                data = source.read_bytes()
                records = cf.parse_file(
                    data,
                    kind=cf.KIND_COMPANION,
                    layout=cache.layout,
                    fingerprint=cache.fingerprint,
                    key_tokens=tokens,
                )
            except (OSError, StateFormatError) as exc:
                log.warning("checkpoints of %s skipped: %s", Path(path).name, exc)
        added = sum(cache.add(tokens[:n], ckpt, "saved") for n, ckpt in records)
        cache.stats.added += added
        if tokens:
            cache.take(tokens, seq, "saved")
        return added
