"""``--cache-dir``: the prefix cache's checkpoints kept on disk across restarts, read lazily.

Layout::

    DIR/<first 16 hex digits of the model fingerprint>/<sha256 of the key tokens, 32 hex digits>.rsck

one file per checkpoint, an *entry* of :mod:`rsmem.memory.checkpoint_file` (a header with the model
fingerprint, the memory's layout and the key tokens, then one record with the rows and its checksum).
Each model (a fingerprint: architecture, sizes, state layout and sampled weights) has its own folder, so
files of another model are never looked at; a file in the folder whose header names another model or
layout is ignored all the same.

- **Writing**: every checkpoint the cache keeps is written when it is taken: to a temporary file in the
  folder, renamed over its name once complete (a crash leaves a ``.tmp`` file, deleted at the next start,
  never a torn entry). No fsync: a file torn by a power cut fails its checksum and is dropped.
- **Start**: the folder is scanned and only the headers are read (the key tokens); the tree of keys is
  rebuilt from them; rows stay on disk. A header that does not parse, a file whose size is not what its
  header and record size say, or whose name is not its key's, is logged (warning) and deleted.
- **Use**: a match reads that one file, checks every record field and its checksum, and decodes the rows;
  a file that fails is logged, deleted and forgotten, and never served.
- **Budget**: ``budget_bytes`` of files (``--cache-disk``, MiB); past it, the entries worth least per byte
  go first (the same score as in RAM, :mod:`rsmem.engine.prefix_cache`) and their files are deleted.

Not thread-safe: the engine's thread owns it.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rsmem.engine.prefix_cache import Match, PrefixCache
from rsmem.errors import StateFormatError
from rsmem.memory import checkpoint_file as cf
from rsmem.memory.checkpoint import Checkpoint

log = logging.getLogger("rsmem.cache_dir")
SUFFIX = ".rsck"


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
    write_errors: int = 0
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
        self.tree: PrefixCache[DiskEntry] = PrefixCache(budget_bytes, on_evict=self._evicted)
        self._scan()

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
        try:
            data = path.read_bytes()
            ((_, ckpt),) = cf.parse_file(
                data, kind=cf.KIND_ENTRY, layout=self.layout, fingerprint=self.fingerprint, key_tokens=tokens
            )
        except (OSError, StateFormatError) as exc:
            log.warning("cache dir: dropping %s: %s", path.name, exc)
            self.stats.corrupt += 1
            self.tree.remove(found.handle)
            path.unlink(missing_ok=True)
            return None
        self.tree.match(tokens, max_len=len(tokens))  # a hit: recency and value
        self.stats.loaded += 1
        return ckpt

    # ------------------------------------------------------------- writing

    def put(self, tokens: Sequence[int], ckpt: Checkpoint) -> bool:
        """Keep ``ckpt`` as the checkpoint after ``tokens`` (replacing the file of the same key); False
        when it does not fit the budget or cannot be written (the cache is then as it was)."""
        data = cf.entry_bytes(self.layout, self.fingerprint, tokens, ckpt)
        if len(data) > self.tree.budget_bytes:
            return False
        path = self.dir / entry_name(tokens)
        tmp: str | None = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if self.tree.insert(tokens, DiskEntry(path, len(data)), kind="disk") is None:
                raise OSError("no room")  # only pins refuse a fitting entry, and nothing pins these
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            log.warning("cache dir: cannot write %s: %s", path.name, exc)
            self.stats.write_errors += 1
            found = self.tree.match(tokens, max_len=len(tokens), touch=False)
            if found is not None and found.n_tokens == len(tokens) and not path.exists():
                self.tree.remove(found.handle)
            return False
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        self.stats.written += 1
        return True

    # ------------------------------------------------------------- internals

    def _evicted(self, entry: DiskEntry) -> None:
        self.stats.evictions += 1
        entry.path.unlink(missing_ok=True)

    def _scan(self) -> None:
        for path in sorted(self.dir.iterdir()):
            if path.name.endswith(".tmp"):  # a write that never finished
                path.unlink(missing_ok=True)
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
            path.unlink(missing_ok=True)
            return None
        try:
            cf.check_header(header, kind=cf.KIND_ENTRY, layout=self.layout, fingerprint=self.fingerprint)
        except StateFormatError as exc:
            log.warning("cache dir: ignoring %s: %s", path.name, exc)
            self.stats.foreign += 1
            return None
        return header.key_tokens
