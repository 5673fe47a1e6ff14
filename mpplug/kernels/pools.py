"""Process-wide thread pools for kernels' work that runs outside the GIL (XLA compiles, X25519
products): each made on first use (one thread per core unless told fewer), and forgotten in a
forked child, which has none of its parent's threads."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


class SharedPool:
    """A lazily made `ThreadPoolExecutor` named `prefix`-N, of os.cpu_count() threads less
    `spare` (at least one)."""

    def __init__(self, prefix: str, spare: int = 0) -> None:
        self.prefix = prefix
        self.spare = spare
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                threads = max(1, (os.cpu_count() or 1) - self.spare)
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix=self.prefix)
            return self._pool

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()
