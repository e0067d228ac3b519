"""The engine's sequences: which are free, which keep a finished prompt's state, which a session holds.

A sequence is in exactly one of three places: running a request (neither free nor held), free (maybe
with a cached state and the tokens it folds, oldest cache first), or held by a session. The pool only
does bookkeeping; it changes the memory through two callbacks: ``clear(seq)`` empties a sequence's
state, and ``trim(seq, n)`` rolls it back to its first ``n`` tokens (a memory with ``n_rs_seq`` can,
for its last ``rollback_depth`` tokens) and says whether it could.

A new prompt reuses a free sequence's cached state when the prompt extends the tokens it folds, or,
with a rollback depth, when the two part at most ``rollback_depth`` tokens before the cached end (a chat
client re-sending the last answer re-tokenized, a regenerate of a short answer).

A cached state is only ever a cache: where the memory's cells are shared (a unified KV cache), the cells a
request needs come first, and cached states give way to it, the one cached longest ago first
(:meth:`SequencePool.evict_until`), as llama.cpp's server clears idle slots.
"""

from __future__ import annotations

from collections.abc import Callable

from rsmem.engine.request import Session


class SequencePool:
    def __init__(
        self,
        n_seq: int,
        clear: Callable[[int], None],
        *,
        prompt_cache: bool,
        trim: Callable[[int, int], bool] | None = None,
        rollback_depth: int = 0,
    ) -> None:
        self.n_seq = n_seq
        self.prompt_cache = prompt_cache
        self._clear = clear
        self._trim = trim
        self.rollback_depth = rollback_depth if trim is not None else 0
        self._free: list[int] = list(range(n_seq))
        self._cached: dict[int, list[int]] = {}  # free seq -> tokens its state folds (insertion = age)
        self._sessions: dict[int, Session] = {}

    # ------------------------------------------------------------- queries

    @property
    def free(self) -> tuple[int, ...]:
        return tuple(self._free)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def is_free(self, seq: int) -> bool:
        return seq in self._free

    @property
    def held(self) -> set[int]:
        """The sequences sessions hold."""
        return set(self._sessions)

    def session_of(self, seq: int) -> Session | None:
        return self._sessions.get(seq)

    def cached_tokens(self, seq: int) -> list[int]:
        """Tokens a free sequence's cached state folds ([] when it caches nothing)."""
        return self._cached.get(seq, [])

    def best_free(self, prompt: list[int], avoid: set[int] | frozenset[int] = frozenset()) -> int:
        """The free sequence whose cached state covers most of ``prompt`` (a proper prefix); else one
        holding no cache; else the one cached longest ago. Sequences in ``avoid`` are taken last. The
        pool must have a free sequence."""
        free = [s for s in self._free if s not in avoid] or list(self._free)
        best, best_len = -1, 0
        for seq in self._cached:
            n = self.covered(seq, prompt)[0] if seq in free else 0
            if n > best_len:
                best, best_len = seq, n
        if best >= 0:
            return best
        uncached = [s for s in free if s not in self._cached]
        return min(uncached) if uncached else next(s for s in self._cached if s in free)

    def covered(self, seq: int, prompt: list[int]) -> tuple[int, bool]:
        """How many of ``prompt``'s tokens ``seq``'s cached state can serve (always fewer than the
        prompt's), and whether that needs a rollback of the state; ``(0, False)`` when none."""
        tokens = self._cached.get(seq)
        if not tokens:
            return 0, False
        if len(tokens) < len(prompt) and prompt[: len(tokens)] == tokens:
            return len(tokens), False
        if not self.rollback_depth:
            return 0, False
        n, limit = 0, min(len(tokens), len(prompt) - 1)
        while n < limit and tokens[n] == prompt[n]:
            n += 1
        if n and len(tokens) - n <= self.rollback_depth:
            return n, True
        return 0, False

    # ------------------------------------------------------------ changes

    def take(self, seq: int, prompt: list[int]) -> tuple[int, bool]:
        """Take a free sequence for a request; returns how many prompt tokens its cached state serves
        (the state is kept, rolled back if needed) and whether it was rolled back; else ``(0, False)``
        (the state is cleared)."""
        reused, cut = self.covered(seq, prompt)
        if cut and self._trim is not None and not self._trim(seq, reused):
            reused, cut = 0, False
        self._free.remove(seq)
        self._cached.pop(seq, None)
        if not reused:
            self._clear(seq)
        return reused, cut

    def release(self, seq: int, folded: list[int] | None) -> None:
        """Return a sequence; with the prompt cache and ``folded`` tokens, its state stays for reuse."""
        if self.prompt_cache and folded:
            self._cached[seq] = folded
        else:
            self._clear(seq)
        self._free.append(seq)

    def hold(self, seq: int, session: Session) -> None:
        """Give a taken sequence to a session, which keeps it between requests."""
        self._sessions[seq] = session

    def unhold(self, seq: int) -> None:
        """A closed session's sequence: cleared and free."""
        del self._sessions[seq]
        self.release(seq, None)

    def set_cached(self, seq: int, tokens: list[int] | None) -> None:
        """Record what a free sequence's state folds (after a restore), or that it holds nothing."""
        self._cached.pop(seq, None)
        if tokens is not None:
            self._cached[seq] = tokens

    def erase(self, seq: int) -> int:
        """Clear a free sequence's cached state; returns the number of tokens it held."""
        self._clear(seq)
        return len(self._cached.pop(seq, []))

    def evict_until(self, fits: Callable[[], bool]) -> bool:
        """Clear free sequences' cached states, the one cached longest ago first, until ``fits()``;
        returns whether it does. A session's state and a running request's are never touched."""
        while not fits():
            if not self._cached:
                return False
            self.erase(next(iter(self._cached)))
        return True
