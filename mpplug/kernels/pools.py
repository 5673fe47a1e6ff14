"""Process-wide thread pools for kernels' work that runs outside the GIL (XLA compiles, X25519
products): each made on first use with one thread per core, and forgotten in a forked child,
which has none of its parent's threads."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


class SharedPool:
    """A lazily made `ThreadPoolExecutor` of os.cpu_count() threads named `prefix`-N."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix=self.prefix)
            return self._pool

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()
