"""The kernel registry: `fn_type` -> the callable that runs PFunctions of that type.

Filled lazily from the entry-point group `mpplug.kernels` and by the `@kernel` decorator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from mpplug.errors import DuplicateKernelError, UnknownKernelError

if TYPE_CHECKING:
    from mpplug.core import PFunction
    from mpplug.kernels.runtime import KernelRuntime

ENTRY_POINT_GROUP = "mpplug.kernels"

Kernel = Callable[["PFunction", Sequence[Any], "KernelRuntime"], Sequence[Any]]
"""A kernel runs one PFunction on checked arguments and returns its outputs."""


@dataclass
class _Entry:
    described: str | None = None
    kernel: Kernel | None = None
    entry_point: EntryPoint | None = None

    @property
    def source(self) -> str:
        """Where the kernel comes from, for error messages: asked only then, as an entry
        point's distribution name and version are read from its metadata file."""
        if self.described is not None:
            return self.described
        ep = self.entry_point
        assert ep is not None
        dist = getattr(ep, "dist", None)
        owner = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
        return f"entry point {ep.value!r} ({owner})"


class KernelRegistry:
    """Maps `fn_type` to a kernel; entry points are discovered on first lookup."""

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self._group = group
        self._entries: dict[str, _Entry] = {}
        self._discovered = False
        self._lock = threading.RLock()

    def register(self, fn_type: str, kernel: Kernel, source: str | None = None) -> None:
        """Register `kernel` for `fn_type`; a second registration is a DuplicateKernelError."""
        with self._lock:
            self._discover()
            self._add(fn_type, _Entry(source or _describe(kernel), kernel=kernel))

    def lookup(self, fn_type: str) -> Kernel:
        """The kernel for `fn_type`, loading its entry point on first use."""
        entry = self._entries.get(fn_type) if self._discovered else None
        if entry is not None and entry.kernel is not None:
            return entry.kernel
        with self._lock:
            self._discover()
            entry = self._entries.get(fn_type)
            if entry is None:
                known = ", ".join(sorted(self._entries)) or "none"
                raise UnknownKernelError(
                    f"no kernel serves fn_type {fn_type!r}; registered: {known}"
                )
            if entry.kernel is None:
                assert entry.entry_point is not None
                entry.kernel = entry.entry_point.load()
            return entry.kernel

    def fn_types(self) -> list[str]:
        with self._lock:
            self._discover()
            return sorted(self._entries)

    def _discover(self) -> None:
        if self._discovered:
            return
        for ep in entry_points(group=self._group):
            self._add(ep.name, _Entry(entry_point=ep))
        self._discovered = True

    def _add(self, fn_type: str, entry: _Entry) -> None:
        existing = self._entries.get(fn_type)
        if existing is not None:
            same_entry_point = (
                existing.entry_point is not None
                and entry.entry_point is not None
                and existing.entry_point.value == entry.entry_point.value
            )
            if same_entry_point or (entry.kernel is not None and entry.kernel is existing.kernel):
                return  # one distribution seen twice on sys.path, or the same function again
            raise DuplicateKernelError(
                f"fn_type {fn_type!r} is registered twice: by {existing.source} "
                f"and by {entry.source}"
            )
        self._entries[fn_type] = entry


def _describe(kernel: Kernel) -> str:
    module = getattr(kernel, "__module__", "?")
    name = getattr(kernel, "__qualname__", repr(kernel))
    return f"{module}.{name}"


REGISTRY = KernelRegistry()


def kernel(fn_type: str) -> Callable[[Kernel], Kernel]:
    """Decorator: register the function as the kernel for `fn_type` in the global registry."""

    def decorate(fn: Kernel) -> Kernel:
        REGISTRY.register(fn_type, fn)
        return fn

    return decorate
