"""What outlives a request: sessions (a conversation's sequence, kept between requests) and slots'
cached states, saved to and restored from llama.cpp sequence files."""

from __future__ import annotations

from rsmem.batch.batch import Batch
from rsmem.context import Context
from rsmem.engine.pool import SequencePool
from rsmem.engine.request import Session
from rsmem.errors import InvalidRequestError


class KeptSequences:
    def __init__(self, context: Context, pool: SequencePool) -> None:
        self.ctx = context
        self.pool = pool

    # ------------------------------------------------------------ sessions

    def open_session(self, path: str | None = None) -> Session:
        if not self.pool.n_free:
            raise RuntimeError("no free sequence for a session: every sequence is in use")
        seq = self.pool.best_free([])
        self.pool.take(seq, [])
        try:
            tokens = self.ctx.state_seq_load_file(path, seq) if path is not None else []
        except BaseException:
            self.pool.release(seq, None)
            raise
        session = Session(seq, tokens=tokens)
        self.pool.hold(seq, session)
        return session

    def save_session(self, session: Session, path: str) -> int:
        """A pending token (sampled, not yet in the state) is decoded first so the file is complete."""
        if session.busy:
            raise RuntimeError("the session has a request running; save it when the request is done")
        if session.closed:
            raise RuntimeError("the session is closed")
        while session.pending:  # in pieces of n_batch: a prompt interrupted early leaves a long tail
            piece = session.pending[: self.ctx.n_batch]
            self.ctx.decode(Batch(piece, seq_ids=[[session.seq_id]] * len(piece)))
            session.tokens += piece
            del session.pending[: len(piece)]
        return self.ctx.state_seq_save_file(path, session.seq_id, session.tokens)

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
        return len(tokens), self.ctx.state_seq_save_file(path, slot, tokens)

    def slot_restore(self, slot: int, path: str) -> int:
        """A prompt extending the file's tokens continues from its state. A file that does not load
        (truncated, corrupt, non-finite) leaves the slot as it was."""
        self._idle_slot(slot)
        tokens = self.ctx.state_seq_load_file(path, slot)
        self.pool.set_cached(slot, tokens if tokens or self.ctx.memory.seq_pos_max(slot) >= 0 else None)
        return len(tokens)

    def slot_erase(self, slot: int) -> int:
        self._idle_slot(slot)
        return self.pool.erase(slot)
