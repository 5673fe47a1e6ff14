"""Builtin kernels (constant, rank, random, identity, counter, read, write, check_range) and the
PFunctions that call them.

They are registered through entry points exactly like any third-party kernel.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mpplug.core import DType, PFunction, TensorType, ValueType
from mpplug.errors import FixedPointRangeError, InvalidPFunctionError
from mpplug.kernels.runtime import DEFAULT_CACHE_SIZE, KernelRuntime, LRUCache

CONSTANT = "mpplug.constant"
RANK = "mpplug.rank"
RANDOM = "mpplug.random"
IDENTITY = "mpplug.identity"
COUNTER = "mpplug.counter"
READ = "mpplug.read"
WRITE = "mpplug.write"
CHECK_RANGE = "mpplug.check_range"

RANK_TYPE = TensorType(DType.INT32, ())
INDEX_TYPE = TensorType(DType.INT32, ())
FLAG_TYPE = TensorType(DType.BOOL, ())


def constant_pfunction(*values: Any) -> PFunction:
    """A PFunction of no inputs giving `values`, its body their raw little-endian bytes laid
    end to end."""
    types = tuple(TensorType.of(value) for value in values)
    body = b"".join(
        np.asarray(value, dtype=t.dtype.numpy, order="C").tobytes()
        for value, t in zip(values, types, strict=True)
    )
    return PFunction(CONSTANT, "constant", body, (), types)


def rank_pfunction() -> PFunction:
    return PFunction(RANK, "rank", b"", (), (RANK_TYPE,))


RANDOM_DTYPES = (DType.UINT32, DType.UINT64)


def random_pfunction(shape: Sequence[int], dtype: Any = DType.UINT32) -> PFunction:
    """() -> u32 or u64 words of `shape` from the party's cryptographic source."""
    kind = DType.from_any(dtype)
    if kind not in RANDOM_DTYPES:
        raise ValueError(f"expected a dtype among uint32, uint64, got {kind.value}")
    if any(d < 0 for d in shape):
        raise ValueError(f"expected non-negative dimensions, got {tuple(shape)}")
    return PFunction(RANDOM, "random", b"", (), (TensorType(kind, tuple(shape)),))


def identity_pfunction(types: Sequence[TensorType]) -> PFunction:
    return PFunction(IDENTITY, "identity", b"", tuple(types), tuple(types))


def counter_pfunction(stop: int) -> PFunction:
    """i32[] -> (i32[], bool[]): the next index, and whether it is below `stop`; the step of
    `mp.fori_loop`, run on the host so a loop step costs no device dispatch."""
    return PFunction(
        COUNTER, "counter", b"", (INDEX_TYPE,), (INDEX_TYPE, FLAG_TYPE), {"stop": int(stop)}
    )


def read_pfunction(name: str, ttype: ValueType) -> PFunction:
    """() -> ttype: the party's dataset `name` (see `mpplug.kernels.datasets`)."""
    return PFunction(READ, "read", b"", (), (ttype,), {"name": name})


def write_pfunction(name: str, ttype: ValueType, format: str = "npy") -> PFunction:
    """ttype -> bool[]: writes the value as the party's output `name` (`<name>.<format>`:
    npy for an array, parquet or csv for a table); returns True."""
    return PFunction(WRITE, "write", b"", (ttype,), (FLAG_TYPE,), {"name": name, "format": format})


def check_range_pfunction(ttype: TensorType, limit: float, label: str) -> PFunction:
    """ttype -> ttype: the value itself once every element is finite with |v| < `limit`;
    otherwise `FixedPointRangeError` naming `label` (what the value is in the program)."""
    return PFunction(
        CHECK_RANGE, "check_range", b"", (ttype,), (ttype,), {"limit": float(limit), "label": label}
    )


def _dataset_name(pfunc: PFunction) -> str:
    name = pfunc.attrs.get("name")
    if not isinstance(name, str):
        raise InvalidPFunctionError(
            f"{pfunc.fn_type}: expected a str attribute 'name', got {name!r}"
        )
    return name


def _single_output(pfunc: PFunction) -> ValueType:
    if len(pfunc.outs_info) != 1:
        raise InvalidPFunctionError(
            f"{pfunc.fn_type}: expected exactly one output type, got {len(pfunc.outs_info)}"
        )
    return pfunc.outs_info[0]


def _tensor_output(pfunc: PFunction) -> TensorType:
    ttype = _single_output(pfunc)
    if not isinstance(ttype, TensorType):
        raise InvalidPFunctionError(f"{pfunc.fn_type}: expected an array output, got {ttype}")
    return ttype


CONSTANTS_BYTES = 64 << 20
"""Constants a party keeps on its device between runs, in bytes (least recently used dropped
first)."""


def run_constant(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    """The constants, placed on the party's device once and kept there: a JAX function reading
    one then takes it as it is, as it takes the results of other JAX functions, instead of
    moving a host array at each call."""
    types = [t for t in pfunc.outs_info if isinstance(t, TensorType)]
    if not types or len(types) != len(pfunc.outs_info):
        raise InvalidPFunctionError(
            f"{CONSTANT}: expected one or more array outputs, got "
            f"({', '.join(map(str, pfunc.outs_info))})"
        )
    size = sum(t.nbytes for t in types)
    if len(pfunc.fn_body) != size:
        raise InvalidPFunctionError(
            f"{CONSTANT}: {', '.join(map(str, types))} need {size} body bytes, "
            f"got {len(pfunc.fn_body)}"
        )
    kept = runtime.cache(CONSTANT, _nbytes, CONSTANTS_BYTES)
    return list(kept.get_or_create(pfunc.digest, lambda: _shared(pfunc, types, runtime)))


def _nbytes(arrays: tuple[Any, ...]) -> int:
    return sum(a.nbytes for a in arrays)


_PLACED: LRUCache[tuple[str, Any], tuple[Any, ...]] = LRUCache(
    DEFAULT_CACHE_SIZE, weigh=_nbytes, max_weight=CONSTANTS_BYTES
)
"""Constants any runtime of this process placed, by digest and device: a Simulator's parties
share a device, and place each constant once between them (a round's PRF offsets: 253
arrays in the CNN inference, 9 ms of `jax.device_put`). JAX arrays are immutable."""


def _shared(pfunc: PFunction, types: list[TensorType], runtime: KernelRuntime) -> tuple[Any, ...]:
    key = (pfunc.digest, runtime.resolved_device())
    return _PLACED.get_or_create(key, lambda: _placed(pfunc, types, runtime))


def _placed(pfunc: PFunction, types: list[TensorType], runtime: KernelRuntime) -> tuple[Any, ...]:
    arrays, at = [], 0
    for t in types:
        flat = np.frombuffer(pfunc.fn_body, t.dtype.numpy, math.prod(t.shape), at)
        arrays.append(flat.reshape(t.shape))
        at += t.nbytes
    with jax.enable_x64(True):  # 64-bit values as they are (this thread only)
        return tuple(jax.device_put(arrays, runtime.resolved_device()))


def run_rank(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    if _single_output(pfunc) != RANK_TYPE:
        raise InvalidPFunctionError(
            f"{RANK}: expected output {RANK_TYPE}, got {pfunc.outs_info[0]}"
        )
    return [np.asarray(runtime.rank, dtype=np.int32)]


def run_random(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    """Uniform uint32 or uint64 words from the operating system's cryptographic source."""
    ttype = _tensor_output(pfunc)
    if ttype.dtype not in RANDOM_DTYPES:
        raise InvalidPFunctionError(f"{RANDOM}: expected a u32 or u64 output, got {ttype}")
    data = secrets.token_bytes(ttype.nbytes)
    return [np.frombuffer(data, dtype=ttype.dtype.numpy).reshape(ttype.shape)]


def run_identity(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    return list(args)


def run_counter(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    stop = pfunc.attrs.get("stop")
    if isinstance(stop, bool) or not isinstance(stop, int):
        raise InvalidPFunctionError(f"{COUNTER}: expected an int attribute 'stop', got {stop!r}")
    if pfunc.ins_info != (INDEX_TYPE,) or pfunc.outs_info != (INDEX_TYPE, FLAG_TYPE):
        raise InvalidPFunctionError(
            f"{COUNTER}: expected {INDEX_TYPE} -> ({INDEX_TYPE}, {FLAG_TYPE}), got {pfunc!r}"
        )
    following = int(args[0]) + 1
    return [np.asarray(following, dtype=np.int32), np.asarray(following < stop)]


def run_read(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    return [runtime.datasets.load(_dataset_name(pfunc), _single_output(pfunc))]


def run_write(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    if pfunc.outs_info != (FLAG_TYPE,) or len(pfunc.ins_info) != 1:
        raise InvalidPFunctionError(f"{WRITE}: expected one input and a {FLAG_TYPE} output")
    fmt = pfunc.attrs.get("format", "npy")
    if not isinstance(fmt, str):
        raise InvalidPFunctionError(f"{WRITE}: expected a str attribute 'format', got {fmt!r}")
    runtime.datasets.write(_dataset_name(pfunc), args[0], fmt)
    return [np.asarray(True)]


def run_check_range(pfunc: PFunction, args: Sequence[Any], runtime: KernelRuntime) -> list[Any]:
    limit, label = pfunc.attrs.get("limit"), pfunc.attrs.get("label")
    if not isinstance(limit, float) or not isinstance(label, str):
        raise InvalidPFunctionError(
            f"{CHECK_RANGE}: expected a float attribute 'limit' and a str 'label', got "
            f"{limit!r} and {label!r}"
        )
    if len(pfunc.ins_info) != 1 or pfunc.outs_info != pfunc.ins_info:
        raise InvalidPFunctionError(f"{CHECK_RANGE}: expected one input and the same output")
    values = np.asarray(args[0])
    outside = ~(np.abs(values) < limit)  # NaN and infinities are outside too
    if outside.any():
        first = int(np.flatnonzero(outside)[0])
        index = tuple(int(i) for i in np.unravel_index(first, values.shape))
        got = float(values.flat[first])
        # a finite value is the owner's data: its size is said, not its value
        shown = repr(got) if not np.isfinite(got) else f"|v| >= {limit:.6g}"
        raise FixedPointRangeError(
            f"{label}: expected finite values with |v| < {limit:.6g}, got {shown} "
            f"at index {index} ({int(outside.sum())} of {values.size} elements outside)"
        )
    return [args[0]]
