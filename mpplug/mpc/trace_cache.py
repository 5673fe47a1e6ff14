"""Traced share programs kept in the persistent compile cache, so that a process tracing an
`mp.mpc.run` another process traced before skips the share program and its rounds' exports.

The key covers everything the recording is made from: the user's jaxpr (its text and
constants), the inputs, the fixed-point and protocol settings, the computing parties, the
platforms, the first PRF stream, and the source of mpplug and the versions of JAX.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from mpplug.kernels.compile_cache import cache_key, disk_cache
from mpplug.kernels.jax_exec import jaxlib_version
from mpplug.mpc.recording import Recording

log = logging.getLogger("mpplug")

FORMAT = "1"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
"""Function reprs in jaxpr params (custom_jvp rules, which mp.mpc never runs) name an address
that differs between processes."""


@functools.cache
def _source_digest() -> str:
    """A hash of mpplug's Python source: an edited checkout never replays stale programs."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _consts_digest(consts: Sequence[Any]) -> str:
    h = hashlib.sha256()
    for c in consts:
        array = np.asarray(c)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def trace_key(closed: ClosedJaxpr, inputs: Sequence[str], settings: Sequence[Any]) -> bytes:
    """The key of a recording traced from `closed` with `inputs` described (type, secret or
    public) and `settings` (everything else it depends on, as printable values)."""
    return cache_key(
        "mpc.trace",
        FORMAT,
        _source_digest(),
        jax.__version__,
        jaxlib_version(),
        _ADDRESS.sub("", str(closed.jaxpr)),
        _consts_digest(closed.consts),
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
