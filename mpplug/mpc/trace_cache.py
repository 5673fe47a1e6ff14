"""Traced share programs kept in the persistent compile cache, so that a process tracing an
`mp.mpc.run` another process traced before skips the share program and its rounds' exports;
and the protocols' own local functions (sharing an input, opening a result), kept in this
process and on disk by the recipe that names what they compute.

The key covers everything the recording is made from: the user's jaxpr (its text and
constants), the inputs, the fixed-point and protocol settings, the computing parties, the
platforms, the first PRF stream, and the source of mpplug and the versions of JAX.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr

from mpplug.core import PFunction, ValueType
from mpplug.kernels.compile_cache import arrays_digest, cache_key, disk_cache, source_digest
from mpplug.kernels.jax_exec import jaxlib_version
from mpplug.kernels.runtime import DEFAULT_CACHE_SIZE, LRUCache
from mpplug.mpc.recording import Recording

log = logging.getLogger("mpplug")

FORMAT = "2"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
"""Function reprs in jaxpr params (custom_jvp rules, which mp.mpc never runs) name an address
that differs between processes."""


def trace_key(closed: ClosedJaxpr, inputs: Sequence[str], settings: Sequence[Any]) -> bytes:
    """The key of a recording traced from `closed` with `inputs` described (type, secret or
    public) and `settings` (everything else it depends on, as printable values)."""
    return cache_key(
        "mpc.trace",
        FORMAT,
        source_digest(),
        jax.__version__,
        jaxlib_version(),
        _ADDRESS.sub("", str(closed.jaxpr)),
        arrays_digest(closed.consts),
        repr(list(inputs)),
        repr(list(settings)),
    )


def load(key: bytes) -> Recording | None:
    """The recording stored under `key`, or None."""
    disk = disk_cache()
    payload = disk.get(key) if disk is not None else None
    if payload is None:
        return None
    try:
        return Recording.from_bytes(payload)
    except Exception as exc:  # an entry from an older format: rebuilt
        log.warning("mpplug compile cache: ignoring a traced program (%s)", exc)
        return None


def store(key: bytes, recording: Recording) -> None:
    disk = disk_cache()
    if disk is not None:
        disk.put(key, recording.to_bytes())


Local = tuple[PFunction, bool]
"""A protocol's local function, and whether it gives one result (else a list of them)."""

FUNCTIONS_BYTES = 16 << 20
_FUNCTIONS: LRUCache[tuple[Any, ...], Local] = LRUCache(
    DEFAULT_CACHE_SIZE, weigh=lambda f: len(f[0].fn_body), max_weight=FUNCTIONS_BYTES
)


def local_function(
    recipe: Hashable,
    types: Sequence[ValueType],
    platforms: tuple[str, ...] | None,
    make: Callable[[], Local | None],
) -> Local | None:
    """The function a protocol traced for `recipe` (a value whose repr names everything it
    computes besides its arguments' `types`, the protocol's name first) on `platforms` (None:
    this process's default backend): kept from an earlier call in this process or another
    one, else `make()`'s (None: nothing to keep). With the persistent cache off, nothing is
    kept by recipe, in memory either: each call makes its function from the code as it is."""
    disk = disk_cache()
    if disk is None:
        return make()
    target = platforms if platforms else (jax.default_backend(),)
    memo_key = (recipe, tuple(types), target)
    found = _FUNCTIONS.get(memo_key)
    if found is not None:
        return found
    key = cache_key(
        "mpc.local",
        FORMAT,
        source_digest(),
        jax.__version__,
        jaxlib_version(),
        repr(recipe),
        repr(list(types)),
        repr(target),
    )
    payload = disk.get(key)
    if payload is not None:
        try:
            found = PFunction.from_bytes(payload[1:]), payload[:1] == b"1"
        except Exception as exc:  # an entry from an older format: rebuilt
            log.warning("mpplug compile cache: ignoring a local function (%s)", exc)
    if found is None:
        found = make()
        if found is None:
            return None
        disk.put(key, (b"1" if found[1] else b"0") + found[0].to_bytes())
    _FUNCTIONS.put(memo_key, found)
    return found
