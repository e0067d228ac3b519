"""``--cache-dir``: the prefix cache's checkpoints kept on disk across restarts, read lazily.

Layout::

    DIR/<first 16 hex digits of the model fingerprint>/<sha256 of the key tokens, 32 hex digits>.rsck

one file per checkpoint, an *entry* of :mod:`rsmem.memory.checkpoint_file` (a header with the model
fingerprint, the memory's layout and the key tokens, then one record with the rows and its checksum).
Each model (a fingerprint: architecture, sizes, state layout and sampled weights) has its own folder, so
files of another model are never looked at; a file in the folder whose header names another model or
layout is ignored all the same.

- **Writing**: every checkpoint the cache keeps is serialised and written by one background thread
  (serialising and writing a state takes about a decode step's time, too long to hold the engine's
  thread, which only hands the checkpoint over), to a temporary file
  renamed over its name once complete: a crash leaves a ``.tmp`` file, deleted at the next start, never
  a torn entry. No fsync: a file torn by a power cut fails its checksum and is dropped. Until its file
  is written an entry is served from the checkpoint waiting for it; deletions (evictions, corrupt
  files) queue behind the writes. Pending writes are finished at interpreter exit and before another
  ``DiskCache`` scans its folder; past ``MAX_PENDING_BYTES`` of waiting checkpoints a new one waits.
- **Start**: the folder is scanned and only the headers are read (the key tokens); the tree of keys is
  rebuilt from them; rows stay on disk. A header that does not parse, a file whose size is not what its
  header and record size say, or whose name is not its key's, is logged (warning) and deleted.
- **Use**: a match reads that one file, checks every record field and its checksum, and decodes the rows;
  a file that fails is logged, deleted and forgotten, and never served.
- **Budget**: ``budget_bytes`` of files (``--cache-disk``, MiB); past it, the entries worth least per byte
  go first (the same score as in RAM, :mod:`rsmem.engine.prefix_cache`) and their files are deleted.
- **A folder that is not writable** (a read-only mount, a pre-filled cache shared by several servers):
  found at start with one warning; its files are read and served, nothing is written or deleted there,
  and new checkpoints stay in RAM. A write that fails later (a full disk) is counted in
  ``stats.write_errors``, never in ``stats.written`` (files actually written), and its entry is forgotten
  at its first use; the first of a run of failures is logged as a warning, the rest at debug level.

Not thread-safe: the engine's thread owns it (the writer thread only writes and deletes files).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rsmem.engine.prefix_cache import Match, PrefixCache
from rsmem.errors import StateFormatError
from rsmem.memory import checkpoint_file as cf
from rsmem.memory.checkpoint import Checkpoint

log = logging.getLogger("rsmem.cache_dir")
SUFFIX = ".rsck"
MAX_PENDING_BYTES = 256 << 20


class _Writer:
    """One thread doing every cache dir's file jobs in order."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rsmem-cache-dir", daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def flush(self) -> None:
        """Wait until every job submitted so far is done."""
        self._jobs.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # a job logs its own errors; this keeps the thread alive whatever happens
                log.exception("cache dir: a file job failed")
            finally:
                self._jobs.task_done()


WRITER = _Writer()
atexit.register(WRITER.flush)


@dataclass(frozen=True, slots=True)
class DiskEntry:
    path: Path
    nbytes: int  # the file's size


@dataclass(slots=True)
class DiskStats:
    found: int = 0  # entries found at start
    written: int = 0
    loaded: int = 0
    corrupt: int = 0  # files dropped: unreadable, truncated, failing a checksum
    foreign: int = 0  # files of another model or memory shape, ignored
    write_errors: int = 0  # files that could not be written
    evictions: int = 0


def entry_name(tokens: Sequence[int]) -> str:
    return cf.token_digest([int(t) for t in tokens]).hex()[:32] + SUFFIX


class DiskCache:
    def __init__(
        self, root: str | os.PathLike[str], layout: cf.Layout, fingerprint: bytes, budget_bytes: int
    ):
        self.layout = layout
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = DiskStats()
        self.writable = self._probe()
        self._failed: set[Path] = set()  # entries whose write failed (the writer thread adds them)
        self._failing = False  # the last write failed: the next failure is logged at debug level
        self.tree: PrefixCache[DiskEntry] = PrefixCache(budget_bytes, on_evict=self._evicted)
        self._pending: dict[Path, Checkpoint] = {}  # entries whose file is still to be written
        self._pending_lock = threading.Lock()
        WRITER.flush()  # an earlier cache of this process may still be writing into the folder
        self._scan()

    def flush(self) -> None:
        """Wait until every file written or deleted so far is on disk."""
        WRITER.flush()

    @property
    def nbytes(self) -> int:
        return self.tree.nbytes

    def __len__(self) -> int:
        return len(self.tree)

    # ------------------------------------------------------------- reading

    def match(self, tokens: Sequence[int], max_len: int) -> Match[DiskEntry] | None:
        """The entry of the longest key that is a prefix of ``tokens``, at most ``max_len`` long (looks
        only)."""
        return self.tree.match(tokens, max_len=max_len, touch=False)

    def keys_along(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """Lengths of the stored keys that are prefixes of ``tokens``."""
        return self.tree.along(tokens)

    def load(self, tokens: Sequence[int]) -> Checkpoint | None:
        """The checkpoint stored under exactly ``tokens``, read and checked now; None when there is none
        or its file fails (it is then deleted, with a warning)."""
        found = self.tree.match(tokens, max_len=len(tokens), touch=False)
        if found is None or found.n_tokens != len(tokens):
            return None
        path = found.payload.path
        with self._pending_lock:
            unwritten = path in self._failed
            self._failed.discard(path)
        if unwritten:  # its write failed (counted and logged then): forgotten, not a corrupt file
            self.tree.remove(found.handle)
            return None
        try:
            with self._pending_lock:
                pending = self._pending.get(path)
            if pending is not None:
                ckpt = pending
            else:
                data = path.read_bytes()
                ((_, ckpt),) = cf.parse_file(
                    data,
                    kind=cf.KIND_ENTRY,
                    layout=self.layout,
                    fingerprint=self.fingerprint,
                    key_tokens=tokens,
                )
        except (OSError, StateFormatError) as exc:
            log.warning("cache dir: dropping %s: %s", path.name, exc)
            self.stats.corrupt += 1
            self.tree.remove(found.handle)
            self._delete(path)
            return None
        self.tree.match(tokens, max_len=len(tokens))  # a hit: recency and value
        self.stats.loaded += 1
        return ckpt

    # ------------------------------------------------------------- writing

    def put(self, tokens: Sequence[int], ckpt: Checkpoint) -> bool:
        """Keep ``ckpt`` as the checkpoint after ``tokens`` (replacing the file of the same key), written
        in the background; False when it does not fit the budget or the folder is not writable."""
        if not self.writable:
            return False
        key = [int(t) for t in tokens]
        n_kv = 0 if ckpt.kv is None else len(ckpt.kv.positions)  # a hybrid's KV prefix
        size = cf.entry_size(self.layout, len(key), ckpt.codec, n_kv)
        if size > self.tree.budget_bytes:
            return False
        with self._pending_lock:
            backlog = sum(c.nbytes for c in self._pending.values())
        if backlog + ckpt.nbytes > MAX_PENDING_BYTES:
            WRITER.flush()
        path = self.dir / entry_name(key)
        if self.tree.insert(key, DiskEntry(path, size), kind="disk") is None:
            return False  # only pins refuse a fitting entry, and nothing pins these
        with self._pending_lock:
            self._pending[path] = ckpt
            self._failed.discard(path)
        WRITER.submit(lambda: self._write(path, key, ckpt))
        return True

    def _write(self, path: Path, key: list[int], ckpt: Checkpoint) -> None:
        """On the writer thread: the file, through a temporary one."""
        tmp: str | None = None
        try:
            data = cf.entry_bytes(self.layout, self.fingerprint, key, ckpt)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            tmp = None
            self.stats.written += 1
            self._failing = False
        except OSError as exc:  # the entry is forgotten at its first use (see load)
            self.stats.write_errors += 1
            with self._pending_lock:
                self._failed.add(path)
            if self._failing:
                log.debug("cache dir: cannot write %s: %s", path.name, exc)
            else:
                log.warning(
                    "cache dir: cannot write %s: %s (further failures are counted, not logged)",
                    path.name,
                    exc,
                )
            self._failing = True
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            with self._pending_lock:
                if self._pending.get(path) is ckpt:
                    del self._pending[path]

    def _delete(self, path: Path) -> None:
        """Delete ``path`` after the writes queued before (an entry evicted while its write waits); in a
        folder that is not writable, nothing is deleted."""
        with self._pending_lock:
            self._pending.pop(path, None)
            self._failed.discard(path)
        if self.writable:
            WRITER.submit(lambda: _unlink(path))

    def _probe(self) -> bool:
        """Whether files can be created in the folder (a file is created and deleted); one warning when
        they cannot."""
        try:
            fd, tmp = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=self.dir)
            os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            log.warning(
                "cache dir: %s is not writable (%s): its checkpoints are read, new ones are kept in RAM only",
                self.dir,
                exc.strerror or exc,
            )
            return False
        return True

    # ------------------------------------------------------------- internals

    def _evicted(self, entry: DiskEntry) -> None:
        self.stats.evictions += 1
        self._delete(entry.path)

    def _scan(self) -> None:
        for path in sorted(self.dir.iterdir()):
            if path.name.endswith(".tmp"):  # a write that never finished
                if self.writable:
                    _unlink(path)
                continue
            if not path.name.endswith(SUFFIX) or not path.is_file():
                continue
            tokens = self._read_key(path)
            if tokens is not None:
                self.tree.insert(tokens, DiskEntry(path, path.stat().st_size), kind="disk")
                self.stats.found += 1

    def _read_key(self, path: Path) -> tuple[int, ...] | None:
        """The key tokens of a file, from its header and record size; None (file deleted or ignored)
        when it is corrupt, truncated, misnamed, or of another model or memory."""
        try:
            with path.open("rb") as f:
                header = cf.read_header(f.read)
                size_field = f.read(8)
            if len(size_field) != 8:
                raise cf.CheckpointFileError("truncated before its record")
            expected = header.size + 8 + struct.unpack("<Q", size_field)[0]
            if (
                header.kind != cf.KIND_ENTRY
                or path.stat().st_size != expected
                or path.name != entry_name(header.key_tokens)
            ):
                raise cf.CheckpointFileError(f"{path.stat().st_size} bytes, misnamed or not an entry")
        except (OSError, StateFormatError) as exc:
            log.warning("cache dir: dropping %s: %s", path.name, exc)
            self.stats.corrupt += 1
            if self.writable:
                _unlink(path)
            return None
        try:
            cf.check_header(header, kind=cf.KIND_ENTRY, layout=self.layout, fingerprint=self.fingerprint)
        except StateFormatError as exc:
            log.warning("cache dir: ignoring %s: %s", path.name, exc)
            self.stats.foreign += 1
            return None
        return header.key_tokens


def _unlink(path: Path) -> None:
    """Delete a file; a failure is logged (the file stays, and is found again at the next start)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cache dir: cannot delete %s: %s", path.name, exc)
