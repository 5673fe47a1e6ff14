"""The persistent compile cache: compiled executables on disk, so a second process starts warm.

One file per entry, named by a key over everything the executable depends on; each file
carries its key and a hash of its payload, and is written whole or not at all.

Folder: `MPPLUG_CACHE_DIR` (default `$XDG_CACHE_HOME/mpplug`, else `~/.cache/mpplug`); an
empty value, or `0`, `off`, `false`, `no` or `none`, turns the cache off. Size:
`MPPLUG_CACHE_MAX_MB` (default 1024), least recently used entries evicted first. The folder
is private to its user (mode 0700): an entry is trusted like the user's own files, and a
truncated, corrupt or foreign entry is never loaded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import struct
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("mpplug")

ENV_DIR = "MPPLUG_CACHE_DIR"
ENV_MAX_MB = "MPPLUG_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
SUFFIX = ".mpx"
_MAGIC = b"MPPLUGX1"
_HEADER = struct.Struct("<8s32sQ32s")
"""magic, key (sha256), payload length, sha256 of the payload."""


@functools.cache
def source_digest() -> str:
    """A hash of mpplug's Python source, for keys of what mpplug's code produces (exports,
    traced programs): an edited checkout never reads entries an older one wrote."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def arrays_digest(arrays: Sequence[Any]) -> str:
    """A hash of arrays' dtypes, shapes and contents (a jaxpr's constants)."""
    h = hashlib.sha256()
    for a in arrays:
        array = np.asarray(a)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def cache_key(*parts: str) -> bytes:
    """The 32-byte key of an entry: a hash of its parts, each length-prefixed."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


@dataclass
class CacheStats:
    """Counters since the cache was opened: entries found, missed, written, refused
    (truncated, corrupt or foreign; each is removed) and evicted, and scans of the folder."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    refused: int = 0
    evicted: int = 0
    scans: int = 0


LOW_WATER = 0.9
"""An eviction leaves the folder at most this fraction of its bound, so that a full cache is
not scanned again at the next write."""


@dataclass
class DiskCache:
    """Entries under `folder`, at most `max_bytes` in all. The folder is scanned at the first
    write and whenever the bytes this process knows of (that scan plus its own writes) pass
    the bound, not at every write: a folder of 20,000 entries takes a tenth of a second to
    scan. Another process's writes are seen at the next scan."""

    folder: Path
    max_bytes: int
    stats: CacheStats = field(default_factory=CacheStats)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _known_bytes: int | None = field(default=None, repr=False)

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def get(self, key: bytes) -> bytes | None:
        """The payload stored under `key`, or None (missing, or refused and removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._count("misses")
            return None
        payload = _payload(data, key)
        if payload is None:
            log.warning("mpplug compile cache: ignoring a damaged or foreign entry %s", path.name)
            self._count("refused")
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        self._count("hits")
        return payload

    def put(self, key: bytes, payload: bytes) -> None:
        """Store `payload` under `key` atomically (a reader sees the old file, the new one or
        none), then evict the least recently used entries beyond `max_bytes`. A cache that
        cannot be written (read-only folder, full disk) is skipped with a warning."""
        header = _HEADER.pack(_MAGIC, key, len(payload), hashlib.sha256(payload).digest())
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(payload)
                os.replace(tmp, self.path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("mpplug compile cache: cannot write to %s (%s)", self.folder, exc)
            return
        self._count("writes")
        with self._lock:
            known = self._known_bytes
            if known is not None:
                self._known_bytes = known + len(header) + len(payload)
        if known is None or known + len(header) + len(payload) > self.max_bytes:
            self.evict()

    def evict(self) -> None:
        """Scan the folder; when it holds more than `max_bytes`, remove least recently used
        entries until it holds at most LOW_WATER of them."""
        self._count("scans")
        entries = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            with contextlib.suppress(OSError):
                st = path.stat()
                entries.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        if total > self.max_bytes:
            target = int(self.max_bytes * LOW_WATER)
            for _, size, path in sorted(entries, key=lambda e: e[0]):
                if total <= target:
                    break
                with contextlib.suppress(OSError):
                    path.unlink()
                    self._count("evicted")
                total -= size
        with self._lock:
            self._known_bytes = total

    def size(self) -> int:
        """Bytes the entries take now."""
        total = 0
        for path in self.folder.glob(f"*{SUFFIX}"):
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)


def _payload(data: bytes, key: bytes) -> bytes | None:
    if len(data) < _HEADER.size:
        return None
    magic, stored_key, length, digest = _HEADER.unpack_from(data)
    payload = data[_HEADER.size :]
    if magic != _MAGIC or stored_key != key or length != len(payload):
        return None
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload


OFF_VALUES = frozenset({"", "0", "off", "false", "no", "none"})
"""`MPPLUG_CACHE_DIR` values that turn the cache off rather than name a folder (a folder
named `off` in the working directory is never what was meant)."""


def default_folder() -> Path | None:
    """The folder `MPPLUG_CACHE_DIR` names (None: the cache is off), or the default."""
    value = os.environ.get(ENV_DIR)
    if value is not None:
        return None if value.strip().lower() in OFF_VALUES else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpplug"


def _max_bytes() -> int:
    value = os.environ.get(ENV_MAX_MB, "")
    try:
        mb = float(value) if value.strip() else DEFAULT_MAX_MB
    except ValueError:
        log.warning(
            "mpplug compile cache: %s=%r is not a number; using %d",
            ENV_MAX_MB,
            value,
            DEFAULT_MAX_MB,
        )
        mb = DEFAULT_MAX_MB
    return max(0, int(mb * 2**20))


_opened: dict[tuple[Path, int], DiskCache] = {}
_opened_lock = threading.Lock()


def disk_cache() -> DiskCache | None:
    """The cache the environment names now (read at each call, so a process can change it;
    one `DiskCache` per folder and bound), or None when it is off."""
    folder = default_folder()
    if folder is None:
        return None
    bound = _max_bytes()
    with _opened_lock:
        found = _opened.get((folder, bound))
        if found is None:
            found = _opened[(folder, bound)] = DiskCache(folder, bound)
        return found
