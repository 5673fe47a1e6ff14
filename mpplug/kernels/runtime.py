"""`KernelRuntime`: the per-party state kernels run against.

Holds the party's rank, world size, bound device, the bounded caches kernels keep across calls
and the direct calls kernels offer `invoke`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mpplug.core.custom_calls import DEFAULT_POLICY, CustomCallPolicy
from mpplug.kernels.datasets import Datasets

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_CACHE_SIZE = 1024
"""Entries a kernel cache holds at most: a program of several hundred rounds (ten unrolled
epochs of a logistic regression: 640) keeps every executable of its own, and a CPU process
stays near 20,000 memory maps (17 an executable); what they weigh is bounded apart
(`jax_exec.executables_budget`)."""


class LRUCache(Generic[K, V]):
    """A thread-safe, size-bounded least-recently-used cache; `on_evict(key)` runs for each key
    it drops to stay within `maxsize` entries and, with `weigh`, within `max_weight` in all
    (the newest entry stays even when it alone weighs more)."""

    def __init__(
        self,
        maxsize: int = DEFAULT_CACHE_SIZE,
        on_evict: Callable[[K], object] | None = None,
        weigh: Callable[[V], int] | None = None,
        max_weight: int = 0,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"expected maxsize >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.max_weight = max_weight
        self._weigh = weigh
        self._weights: dict[K, int] = {}
        self.weight = 0
        """The entries' total weight (0 without `weigh`)."""
        self._data: OrderedDict[K, V] = OrderedDict()
        self._pending: dict[K, threading.Lock] = {}
        self._lock = threading.Lock()
        self._on_evict = on_evict
        # touch(key): mark `key` the most recently used, or raise KeyError if it is not cached.
        # The dict's own method, for per-call paths: atomic under the GIL, like `get_or_create`'s
        # hot path, and no Python frame.
        self.touch: Callable[[K], None] = self._data.move_to_end

    def get_or_create(self, key: K, create: Callable[[], V]) -> V:
        """The cached value for `key`; when missing, one caller creates it (outside the cache
        lock) while concurrent callers for the same key wait for that value."""
        try:  # the hot path, lock-free: each OrderedDict call is atomic under the GIL
            self._data.move_to_end(key)
            return self._data[key]
        except KeyError:
            pass
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
            pending = self._pending.setdefault(key, threading.Lock())
        with pending:
            with self._lock:
                if key in self._data:  # another caller created it while we waited
                    self._data.move_to_end(key)
                    return self._data[key]
            try:
                value = create()
                self._insert(key, value)
            finally:
                with self._lock:
                    if self._pending.get(key) is pending:
                        del self._pending[key]
        return value

    def put(self, key: K, value: V) -> None:
        """Store `value` under `key`, replacing what was there (weighed afresh)."""
        self._insert(key, value)

    def _insert(self, key: K, value: V) -> None:
        weight = self._weigh(value) if self._weigh is not None else 0
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            self.weight += weight - self._weights.get(key, 0)
            self._weights[key] = weight
            while len(self._data) > self.maxsize or (
                self._weigh is not None and self.weight > self.max_weight and len(self._data) > 1
            ):
                evicted, _ = self._data.popitem(last=False)
                self.weight -= self._weights.pop(evicted, 0)
                if self._on_evict is not None:
                    self._on_evict(evicted)

    def get(self, key: K) -> V | None:
        with self._lock:
            if key not in self._data:
                return None
            self._data.move_to_end(key)
            return self._data[key]

    def discard(self, key: K) -> None:
        """Drop `key` if cached (without `on_evict`: the caller knows)."""
        with self._lock:
            if self._data.pop(key, None) is not None:
                self.weight -= self._weights.pop(key, 0)

    def values(self) -> list[V]:
        """The cached values, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._data.values())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


@dataclass(frozen=True, slots=True)
class DirectCall:
    """How `invoke` runs one PFunction without its kernel when every argument is a JAX array
    (or a numpy array of the declared dtype and shape).

    `call(*arrays)` returns exactly the PFunction's outputs, and refuses arrays whose shapes
    or dtypes differ from its `ins_info` with a ValueError or TypeError (the `jax.exec`
    kernel's jitted function: JAX checks them against the artifact); `touch(digest)` marks
    the PFunction used in the kernel's cache, and raises KeyError once that dropped it.
    """

    call: Callable[..., tuple[Any, ...]]
    n_ins: int
    touch: Callable[[str], None]


class KernelRuntime:
    """One party's kernel-facing state: rank, world size, device and caches.

    `device` is None (the default device), a spec such as "cpu:1" or "cuda:0", or a JAX
    device; kernels resolve it with `resolved_device()`. `datasets` are what `mp.read` and
    `mp.write` reach (default: none). `untrusted_artifacts` says programs come from callers
    this process must survive (a party server's drivers): kernels then check what they load
    more warily (`jax.exec` parses each module in a helper process first). `custom_calls` is
    the policy of the native custom-call targets `jax.exec` compiles. `direct_calls`
    maps a PFunction's digest to the `DirectCall` its kernel offers for it; a key one of the
    runtime's caches evicts leaves it too, so it never outlives the kernel's cached state.
    """

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        device: Any = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        datasets: Datasets | None = None,
        untrusted_artifacts: bool = False,
        custom_calls: CustomCallPolicy | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"expected 0 <= rank < world_size, got rank {rank} of {world_size}")
        if isinstance(device, str):  # a malformed spec fails here, not at the first call
            from mpplug.kernels.devices import parse_device_spec

            parse_device_spec(device)
        self.rank = rank
        self.world_size = world_size
        self.device_spec = device
        self.datasets = datasets if datasets is not None else Datasets(f"rank {rank}")
        self.untrusted_artifacts = untrusted_artifacts
        self.custom_calls = custom_calls if custom_calls is not None else DEFAULT_POLICY
        self._cache_size = cache_size
        self._caches: dict[str, LRUCache[Any, Any]] = {}
        self.direct_calls: dict[str, DirectCall] = {}
        self._device: Any = None
        self._lock = threading.Lock()

    def cache(
        self, namespace: str, weigh: Callable[[Any], int] | None = None, max_weight: int = 0
    ) -> LRUCache[Any, Any]:
        """The bounded cache a kernel keeps under `namespace` (one per kernel type); the first
        call may bound it by weight too (see `LRUCache`)."""
        found = self._caches.get(namespace)
        if found is None:
            with self._lock:
                found = self._caches.get(namespace)
                if found is None:
                    found = self._caches[namespace] = LRUCache(
                        self._cache_size, self._forget_direct_call, weigh, max_weight
                    )
        return found

    def _forget_direct_call(self, key: Any) -> None:
        self.direct_calls.pop(key, None)

    def resolved_device(self) -> Any:
        """The bound JAX device (resolving the spec once), or None for JAX's default."""
        if self._device is None and self.device_spec is not None:
            from mpplug.kernels.devices import resolve_device

            self._device = resolve_device(self.device_spec)
        return self._device

    def __repr__(self) -> str:
        return (
            f"KernelRuntime(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device_spec!r})"
        )


_DEFAULT: KernelRuntime | None = None


def default_runtime() -> KernelRuntime:
    """The process's default single-party runtime (rank 0 of 1, default device)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = KernelRuntime()
    return _DEFAULT
