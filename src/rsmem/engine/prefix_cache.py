"""A prefix cache of state checkpoints: a radix tree over token ids with value-per-byte eviction.

A checkpoint is an opaque payload (anything with ``nbytes: int``, e.g. a copy of a sequence's recurrent
state) stored under the tokens it folds: the payload under ``tokens[:n]`` is the state after those ``n``
tokens. The tree is compressed: every node other than the root holds a checkpoint or has at least two
children, and each edge is a list of tokens. ``match`` and ``insert`` walk one edge per node (a dict
lookup on the edge's first token, then a list comparison), so they cost O(len(tokens)).

Eviction keeps the most valuable bytes under ``budget_bytes``. A checkpoint's score is

    score = (1 + hits) * n_tokens * 0.5 ** ((now - last_used) / half_life) / max(nbytes, 1)

(hits: matches served; n_tokens: the prefill it saves; last_used: its insertion or latest match). The
lowest score goes first; equal scores evict the least recently used, then the oldest handle. A pinned
checkpoint (one being restored right now) is never evicted, removed or replaced until it is unpinned.
The cache only does bookkeeping: it never copies or frees payloads, it drops its references to them;
``on_evict(payload)`` (optional) hears of each checkpoint dropped to make room (a disk tier deletes its file).
An eviction sorts the unpinned checkpoints (O(n log n) in their number). Not thread-safe: one owner calls it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


P = TypeVar("P", bound=HasNbytes)


@dataclass(frozen=True, slots=True)
class Handle:
    """Names one stored checkpoint; it goes stale when the checkpoint is evicted, removed or replaced."""

    id: int


@dataclass(frozen=True, slots=True)
class Match(Generic[P]):
    n_tokens: int  # the payload is the state after tokens[:n_tokens]
    payload: P
    handle: Handle
    kind: str


@dataclass(slots=True)
class CacheStats:
    hits: dict[str, int] = field(default_factory=dict)  # by the kind of the checkpoint served
    misses: int = 0
    insertions: int = 0
    evictions: int = 0  # checkpoints dropped to make room (not removals, replacements or clears)
    bytes: int = 0
    entries: int = 0


@dataclass(slots=True, eq=False)
class _Entry(Generic[P]):
    handle: Handle
    payload: P
    nbytes: int  # read once at insertion
    kind: str
    last_used: float
    hits: int = 0
    pins: int = 0


@dataclass(slots=True, eq=False)
class _Node(Generic[P]):
    edge: list[int]  # the tokens from the parent to this node (empty for the root only)
    parent: _Node[P] | None
    depth: int  # tokens from the root to the end of this node
    children: dict[int, _Node[P]] = field(default_factory=dict)  # by the first token of the child's edge
    entry: _Entry[P] | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common(edge: list[int], toks: list[int], i: int) -> int:
    """The length of the common prefix of ``edge`` and ``toks[i:]``."""
    return common_prefix(edge, toks[i : i + len(edge)])


class PrefixCache(Generic[P]):
    def __init__(
        self,
        budget_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        half_life: float = 300.0,
        on_evict: Callable[[P], None] | None = None,
    ) -> None:
        if budget_bytes < 0 or half_life <= 0:
            raise ValueError(f"budget_bytes must be >= 0 and half_life > 0, got {budget_bytes}, {half_life}")
        self.budget_bytes = budget_bytes
        self.half_life = half_life
        self._clock = clock
        self._on_evict = on_evict
        self._root: _Node[P] = _Node(edge=[], parent=None, depth=0)
        self._nodes: dict[Handle, _Node[P]] = {}  # every live handle -> the node holding its entry
        self._ids = itertools.count(1)
        self._bytes = 0
        self._n_nodes = 0  # excluding the root
        self._stats = CacheStats()

    # ------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, handle: object) -> bool:
        return handle in self._nodes

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def n_nodes(self) -> int:
        """Tree nodes other than the root: at most ``2 * len(self) - 1`` while the tree stays compressed."""
        return self._n_nodes

    @property
    def stats(self) -> CacheStats:
        """A snapshot."""
        s = self._stats
        return CacheStats(dict(s.hits), s.misses, s.insertions, s.evictions, self._bytes, len(self))

    def items(self) -> Iterator[tuple[tuple[int, ...], P, str]]:
        """``(tokens, payload, kind)`` of every checkpoint, shorter keys first along each path."""
        stack: list[tuple[_Node[P], tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, key = stack.pop()
            if node.entry is not None:
                yield key, node.entry.payload, node.entry.kind
            stack.extend((c, key + tuple(c.edge)) for c in node.children.values())

    def divergence(self, tokens: Sequence[int]) -> int:
        """The longest common prefix of ``tokens`` with any path in the tree, checkpoint or not."""
        toks, node, i = list(map(int, tokens)), self._root, 0
        while i < len(toks) and (child := node.children.get(toks[i])) is not None:
            k = _common(child.edge, toks, i)
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def along(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The lengths of the stored keys that are prefixes of ``tokens``, ascending (looks only)."""
        toks, node, found = list(map(int, tokens)), self._root, []
        while True:
            if node.entry is not None and node.depth:
                found.append(node.depth)
            child = node.children.get(toks[node.depth]) if node.depth < len(toks) else None
            if child is None or _common(child.edge, toks, node.depth) < len(child.edge):
                return tuple(found)
            node = child

    def match(
        self, tokens: Sequence[int], *, max_len: int | None = None, touch: bool = True
    ) -> Match[P] | None:
        """The checkpoint with the longest key that is a prefix of ``tokens`` and at most ``max_len`` long.

        Pass ``max_len=len(tokens) - 1`` to keep at least one token to compute. ``touch`` (default) counts a
        hit or a miss and refreshes the checkpoint's recency; ``touch=False`` only looks.
        """
        toks = list(map(int, tokens))
        limit = len(toks) if max_len is None else min(max_len, len(toks))
        best: _Entry[P] | None = None
        best_n, node, i = 0, self._root, 0
        while True:
            if node.entry is not None:
                best, best_n = node.entry, node.depth
            child = node.children.get(toks[i]) if i < len(toks) else None
            if child is None or child.depth > limit or _common(child.edge, toks, i) < len(child.edge):
                break
            node, i = child, child.depth
        if touch:
            if best is None:
                self._stats.misses += 1
            else:
                best.hits += 1
                best.last_used = self._clock()
                self._stats.hits[best.kind] = self._stats.hits.get(best.kind, 0) + 1
        return None if best is None else Match(best_n, best.payload, best.handle, best.kind)

    # ------------------------------------------------------------- changes

    def insert(self, tokens: Sequence[int], payload: P, *, kind: str = "prompt") -> Handle | None:
        """Store ``payload`` as the checkpoint after ``tokens``, replacing one under the same key.

        Evicts the lowest-scored unpinned checkpoints to fit. Returns None, changing nothing, when the payload
        cannot fit beside the pinned ones (or alone exceeds the budget) or the key holds a pinned checkpoint.
        A replacement gets a new handle and keeps the key's hit count.
        """
        toks = list(map(int, tokens))
        if not toks:
            raise ValueError("a checkpoint needs at least one token")
        nbytes = payload.nbytes
        if nbytes < 0:
            raise ValueError(f"payload.nbytes must be >= 0, got {nbytes}")
        old = self._find(toks)
        old_entry = None if old is None else old.entry
        if old_entry is not None and old_entry.pins:
            return None
        freed = 0 if old_entry is None else old_entry.nbytes
        victims, short = self._victims(self._bytes - freed + nbytes - self.budget_bytes, keep=old_entry)
        if short > 0:
            return None
        self._evict(victims)
        node = self._find(toks, create=True)
        assert node is not None
        hits = 0
        if node.entry is not None:  # the replaced checkpoint (never a victim)
            hits = node.entry.hits
            del self._nodes[node.entry.handle]
            self._bytes -= node.entry.nbytes
        handle = Handle(next(self._ids))
        node.entry = _Entry(handle, payload, nbytes, kind, self._clock(), hits=hits)
        self._nodes[handle] = node
        self._bytes += nbytes
        self._stats.insertions += 1
        return handle

    def evict(self, n_bytes: int) -> int:
        """Evicts the lowest-scored unpinned checkpoints until ``n_bytes`` are freed (or none is left).

        Returns the bytes freed.
        """
        before = self._bytes
        self._evict(self._victims(n_bytes, keep=None)[0])
        return before - self._bytes

    def remove(self, handle: Handle) -> bool:
        """Drops a checkpoint. False when the handle is stale or the checkpoint is pinned."""
        node = self._nodes.get(handle)
        if node is None or node.entry is None or node.entry.pins:
            return False
        self._drop(node.entry)
        return True

    def clear(self) -> None:
        """Drops every checkpoint that is not pinned."""
        for node in list(self._nodes.values()):
            if node.entry is not None and not node.entry.pins:
                self._drop(node.entry)

    def pin(self, handle: Handle) -> None:
        """Keeps a checkpoint from eviction, removal and replacement until as many ``unpin`` calls."""
        self._entry(handle).pins += 1

    def unpin(self, handle: Handle) -> None:
        entry = self._entry(handle)
        if entry.pins == 0:
            raise ValueError(f"{handle} is not pinned")
        entry.pins -= 1

    # ------------------------------------------------------------- internals

    def _entry(self, handle: Handle) -> _Entry[P]:
        node = self._nodes.get(handle)
        if node is None or node.entry is None:
            raise KeyError(f"{handle} is not in the cache")
        return node.entry

    def _score(self, e: _Entry[P], now: float) -> float:
        decay: float = 0.5 ** ((now - e.last_used) / self.half_life)
        return (1 + e.hits) * self._nodes[e.handle].depth * decay / max(e.nbytes, 1)

    def _victims(self, need: int, *, keep: _Entry[P] | None) -> tuple[list[_Entry[P]], int]:
        """The lowest-scored unpinned entries (never ``keep``) that free ``need`` bytes, and the bytes still
        missing (> 0 when every candidate together is not enough; the list then holds them all)."""
        if need <= 0:
            return [], need
        now = self._clock()
        entries = [n.entry for n in self._nodes.values() if n.entry is not None and n.entry is not keep]
        order = sorted(
            (e for e in entries if not e.pins), key=lambda e: (self._score(e, now), e.last_used, e.handle.id)
        )
        victims: list[_Entry[P]] = []
        for e in order:
            if need <= 0:
                break
            victims.append(e)
            need -= e.nbytes
        return victims, need

    def _evict(self, victims: list[_Entry[P]]) -> None:
        for v in victims:
            self._drop(v)
            self._stats.evictions += 1
            if self._on_evict is not None:
                self._on_evict(v.payload)

    def _find(self, toks: list[int], *, create: bool = False) -> _Node[P] | None:
        """The node whose path is ``toks``; ``create`` makes it (splitting an edge or adding a leaf)."""
        node, i = self._root, 0
        while i < len(toks):
            child = node.children.get(toks[i])
            if child is None:
                if not create:
                    return None
                child = _Node(edge=toks[i:], parent=node, depth=len(toks))
                node.children[toks[i]] = child
                self._n_nodes += 1
                return child
            k = _common(child.edge, toks, i)
            if k < len(child.edge):
                if not create:
                    return None
                mid: _Node[P] = _Node(edge=child.edge[:k], parent=node, depth=i + k)
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                node.children[toks[i]] = mid
                self._n_nodes += 1
                child = mid
            node, i = child, i + k
        return node

    def _drop(self, entry: _Entry[P]) -> None:
        """Removes ``entry``, then prunes empty leaves and merges a node left with one child into it."""
        node: _Node[P] | None = self._nodes.pop(entry.handle)
        assert node is not None and node.entry is entry
        node.entry = None
        self._bytes -= entry.nbytes
        while node is not None and node.parent is not None and node.entry is None:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
                self._n_nodes -= 1
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[node.edge[0]] = child
                self._n_nodes -= 1
            break
