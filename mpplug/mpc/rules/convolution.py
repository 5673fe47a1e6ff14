"""Convolutions and pooling on shares.

`conv_general_dilated` is bilinear over the ring, so a secret-by-secret convolution is ABY3's
product with the convolution in place of the elementwise product (each role two local
convolutions, exact through f64 chunks; one resharing round: 8 bytes per output element per
party, 3 rounds and 12 bytes with the precise truncation of reals), as SPU computes it; by a
public kernel it is local, plus one truncation for reals. Every form JAX writes (strides,
padding, dilations, feature and batch groups, any dimension numbers) is the same primitive, so
the gradients of a convolution are convolutions too.

Average pooling (`reduce_window_sum`) is local. Max pooling (`reduce_window_max`/`min`)
gathers each window's k elements and runs `selection`'s tournament over them (ceil(log2 k)
levels of 11 rounds). Its gradient (`select_and_scatter_add`) needs the one-hot of each
window's first maximum: for a power-of-two window it reuses the forward pass's comparisons
(kept for the share program) and merges the pairs' one-hots level by level (for 2x2: four
products, two rounds), otherwise it runs the tournament again; the one-hot times the
incoming gradient (one more product) is added back in place (local).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from mpplug.errors import TraceError
from mpplug.mpc import ring
from mpplug.mpc.protocol import Shares
from mpplug.mpc.rules import rule
from mpplug.mpc.rules.comparison import below_arith
from mpplug.mpc.rules.selection import reduce_extremum
from mpplug.mpc.secret import UNSUPPORTED_HINT, Secret, Value, is_float, out_aval

if TYPE_CHECKING:
    from mpplug.mpc.interpreter import Interpreter

_FAR = 1 << 61
"""Ring magnitude that pads a max (min) window: below (above) every value whose comparison
is exact (reals up to 2^(61 - f), integers up to 32 bits keep their own minimum)."""


@rule("conv_general_dilated")
def _conv(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    x, y = values
    dtype = out_aval(eqn).dtype
    params = eqn.primitive.get_bind_params(eqn.params)

    def product(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
        return ring.conv(a, b, **params)

    bits = self.ctx.frac_bits if is_float(dtype) else 0
    if isinstance(x, Secret) and isinstance(y, Secret):
        a, b = self.arith(x, dtype), self.arith(y, dtype)
        return self.out(eqn, self.protocol.bilinear(self.ctx, a, b, product, bits, "conv"))
    if isinstance(x, Secret):
        kernel = self.encode(y, dtype)
        shares = self.protocol.local(lambda a: product(a, kernel), self.arith(x, dtype))
    else:
        image = self.encode(x, dtype)
        shares = self.protocol.local(lambda b: product(image, b), self.arith(y, dtype))
    if bits:
        shares = self.protocol.trunc(self.ctx, shares, bits)
    return self.out(eqn, shares)


@rule("reduce_window_sum")
def _window_sum(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """Sum pooling (`avg_pool` divides it by a public count afterwards): linear, local."""
    return self.linear(eqn, values, None)


@rule("reduce_window_max", "reduce_window_min")
def _window_extremum(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    (x,) = values
    params = eqn.params
    _require_plain_base(self, eqn, params.get("base_dilation"))
    largest = eqn.primitive.name == "reduce_window_max"
    dims, strides = tuple(params["window_dimensions"]), tuple(params["window_strides"])
    padding = tuple(tuple(int(p) for p in pair) for pair in params["padding"])
    dilation = tuple(params.get("window_dilation") or (1,) * len(dims))
    windows = _windows(self, x, dims, strides, padding, dilation, largest)
    k = windows.shape[-1]
    if k & (k - 1) or any(d != 1 for d in dilation):
        best, _ = reduce_extremum(self, windows, windows.ndim - 2, largest, False, x.dtype)
        return self.out(eqn, best)
    # a power-of-two window: its comparisons are kept for the gradient (select_and_scatter_add)
    key = ("window", x, dims, strides, padding, largest)
    best, _ = self.remember(key, lambda: _tournament(self, windows, largest, x.dtype))
    return self.out(eqn, best)


@rule("select_and_scatter_add")
def _select_and_scatter_add(self: Interpreter, eqn: JaxprEqn, values: list[Value]) -> Secret:
    """The gradient of max (min) pooling: each window's incoming gradient added at the
    window's first maximum (minimum) of the operand, as XLA's select-and-scatter does."""
    source, operand = values
    params = eqn.params
    select = params["select_prim"].name
    if select not in ("ge", "gt", "le", "lt"):
        raise TraceError(
            f"{self.where}: select_and_scatter_add selecting with {select!r} is not "
            f"supported (only ge/gt/le/lt, as max and min pooling write it); {UNSUPPORTED_HINT}"
        )
    largest = select in ("ge", "gt")
    dtype = out_aval(eqn).dtype
    shape = tuple(operand.shape)
    dims, strides, padding = (
        params["window_dimensions"],
        params["window_strides"],
        params["padding"],
    )
    if not isinstance(operand, Secret):  # a public choice: the gradient's shares, placed
        chosen = _public_onehot(operand, dims, strides, padding, largest)
        incoming = self.arith(source, dtype)
        spread = jnp.broadcast_to(incoming[..., None], (*incoming.shape, chosen.shape[-1]))
        picked = self.protocol.local(lambda s: s * chosen, spread)
        return self.out(eqn, _scatter_windows(self, picked, shape, dims, strides, padding))
    windows = _windows(self, operand, dims, strides, padding, None, largest)
    k = windows.shape[-1]
    if k & (k - 1):
        onehot = _first_extremum_onehot(self, windows, largest, operand.dtype)
    else:  # the forward max-pool's comparisons, when it ran on this operand
        padding_key = tuple(tuple(int(p) for p in pair) for pair in padding)
        key = ("window", operand, tuple(dims), tuple(strides), padding_key, largest)
        _, bits = self.remember(key, lambda: _tournament(self, windows, largest, operand.dtype))
        onehot = _onehot_from_bits(self, bits)
    if isinstance(source, Secret):
        incoming = self.arith(source, dtype)
        spread = jnp.broadcast_to(incoming[..., None], onehot.shape)
        picked = self.protocol.mul(self.ctx, onehot, spread)
    else:  # a public gradient: each share of the one-hot times its encoding, locally
        public = jnp.broadcast_to(self.encode(source, dtype)[..., None], onehot.shape[1:])
        picked = self.protocol.local(lambda s: s * public, onehot)
    return self.out(eqn, _scatter_windows(self, picked, shape, dims, strides, padding))


def _require_plain_base(self: Interpreter, eqn: JaxprEqn, base_dilation: Any) -> None:
    if base_dilation is not None and any(d != 1 for d in base_dilation):
        raise TraceError(
            f"{self.where}: {eqn.primitive.name} with base dilation {tuple(base_dilation)} is "
            f"not supported on secrets (only 1); {UNSUPPORTED_HINT}"
        )


def _fill(dtype: Any, below: bool) -> int:
    """The ring value padding a window: below (or above) every value of `dtype`."""
    if not is_float(dtype) and np.dtype(dtype).itemsize <= 4 and dtype != np.bool_:
        info = np.iinfo(dtype)
        return int(info.min if below else info.max)
    return -_FAR if below else _FAR


def _out_sizes(
    shape: tuple[int, ...],
    dims: tuple[int, ...],
    strides: tuple[int, ...],
    padding: Any,
    dilation: tuple[int, ...],
) -> list[int]:
    padded = [n + lo + hi for n, (lo, hi) in zip(shape, padding, strict=True)]
    return [
        (p - d * (w - 1) - 1) // s + 1
        for p, w, s, d in zip(padded, dims, strides, dilation, strict=True)
    ]


def _windows(
    self: Interpreter,
    x: Secret,
    dims: tuple[int, ...],
    strides: tuple[int, ...],
    padding: Any,
    dilation: tuple[int, ...] | None,
    largest: bool,
) -> Shares:
    """Shares (2, *out, k): each output position's window of x's k elements, in row-major
    window order; padding holds a public value below (above) every value of x's dtype."""
    shape, fill = x.shape, _fill(x.dtype, below=largest)
    shares = self.arith(x, x.dtype)
    dilation = tuple(dilation) if dilation is not None else (1,) * len(shape)
    pads = [(int(lo), int(hi)) for lo, hi in padding]
    if any(lo or hi for lo, hi in pads):
        border = np.pad(np.zeros(shape, np.int64), pads, constant_values=1)
        zero = np.uint64(0)
        shares = self.protocol.local(
            lambda s: lax.pad(s, zero, [(lo, hi, 0) for lo, hi in pads]), shares
        )
        fill_ring = np.asarray(fill, np.int64).astype(np.uint64)
        shares = shares + self.protocol.lift(
            self.ctx, jnp.asarray(border.astype(np.uint64) * fill_ring)
        )
    out = _out_sizes(shape, dims, strides, pads, dilation)
    slices = []
    for offset in itertools.product(*(range(w) for w in dims)):
        start = [o * d for o, d in zip(offset, dilation, strict=True)]
        limit = [b + (n - 1) * s + 1 for b, n, s in zip(start, out, strides, strict=True)]
        slices.append(
            self.protocol.local(
                lambda s, b=start, e=limit: lax.slice(s, b, e, tuple(strides)), shares
            )
        )
    return self.protocol.local(lambda *parts: jnp.stack(parts, axis=-1), *slices)


def _scatter_windows(
    self: Interpreter,
    picked: Shares,
    shape: tuple[int, ...],
    dims: tuple[int, ...],
    strides: tuple[int, ...],
    padding: Any,
) -> Shares:
    """The inverse placement of `_windows` (no dilation): window element j of every output
    position added back where it came from, padding cropped. Local."""
    pads = [(int(lo), int(hi)) for lo, hi in padding]
    padded = [n + lo + hi for n, (lo, hi) in zip(shape, pads, strict=True)]
    out = picked.shape[1:-1]
    zero = np.uint64(0)
    total = None
    for j, offset in enumerate(itertools.product(*(range(w) for w in dims))):
        config = [
            (o, p - (o + (n - 1) * s + 1), s - 1)
            for o, p, n, s in zip(offset, padded, out, strides, strict=True)
        ]
        placed = self.protocol.local(lambda s, c=config, i=j: lax.pad(s[..., i], zero, c), picked)
        total = placed if total is None else total + placed
    assert total is not None
    crop = [(-lo, -hi, 0) for lo, hi in pads]
    return self.protocol.local(lambda s: lax.pad(s, zero, crop), total)


def _first_extremum_onehot(self: Interpreter, windows: Shares, largest: bool, dtype: Any) -> Shares:
    """Arithmetic 0/1 shares (2, *out, k), 1 at each window's first maximum (minimum): the
    window padded to a power of two with values that never win, `_tournament`, and the
    one-hot of its winners."""
    k = windows.shape[-1]
    size = 1 << max(0, (k - 1).bit_length())
    if size == 1:
        return self.protocol.lift(self.ctx, jnp.ones(windows.shape[1:], ring.RING))
    if size > k:
        fill = np.full((*windows.shape[1:-1], size - k), _fill(dtype, below=largest), np.int64)
        far = self.protocol.lift(self.ctx, jnp.asarray(fill.astype(np.uint64)))
        windows = jnp.concatenate([windows, far], axis=-1)
    _, bits = _tournament(self, windows, largest, dtype)
    return _onehot_from_bits(self, bits)[..., :k]


def _tournament(
    self: Interpreter, windows: Shares, largest: bool, dtype: Any
) -> tuple[Shares, list[Shares]]:
    """(each window's maximum (minimum), the arithmetic 0/1 shares of each level's
    comparisons: 1 where the second of a pair wins) over windows of 2^p elements; ties keep
    the first, as XLA's select does."""
    values, bits = windows, []
    while values.shape[-1] > 1:
        a, b = values[..., 0::2], values[..., 1::2]
        bit = below_arith(self, a, b, dtype) if largest else below_arith(self, b, a, dtype)
        bits.append(bit)
        values = a + self.protocol.mul(self.ctx, bit, b - a)
    return values[..., 0], bits


def _onehot_from_bits(self: Interpreter, bits: list[Shares]) -> Shares:
    """The one-hot (2, *out, 2^p) of each window's winner from `_tournament`'s comparisons:
    (1 - bit, bit) at the first level (local), then each level merges two groups as
    concat(a, 0) + bit * concat(-a, b), one product per element of the merged group."""
    first = bits[0]
    one = self.protocol.lift(self.ctx, jnp.ones(first.shape[1:], ring.RING))
    onehot = jnp.stack([one - first, first], axis=-1)
    for bit in bits[1:]:
        low, high = onehot[..., 0::2, :], onehot[..., 1::2, :]
        base = jnp.concatenate([low, jnp.zeros_like(low)], axis=-1)
        moved = jnp.concatenate([-low, high], axis=-1)
        spread = jnp.broadcast_to(bit[..., None], moved.shape)
        onehot = base + self.protocol.mul(self.ctx, spread, moved)
    return onehot[..., 0, :]


def _public_onehot(
    operand: Any, dims: tuple[int, ...], strides: tuple[int, ...], padding: Any, largest: bool
) -> jnp.ndarray:
    """Ring 0/1 (*out, k): each window's first maximum (minimum) of a public operand."""
    x = jnp.asarray(operand)
    fill = -jnp.inf if largest else jnp.inf
    if not jnp.issubdtype(x.dtype, jnp.floating):
        info = jnp.iinfo(x.dtype)
        fill = info.min if largest else info.max
    pads = [(int(lo), int(hi)) for lo, hi in padding]
    x = jnp.pad(x, pads, constant_values=fill)
    out = _out_sizes(tuple(operand.shape), dims, strides, pads, (1,) * len(dims))
    slices = []
    for offset in itertools.product(*(range(w) for w in dims)):
        limit = [b + (n - 1) * s + 1 for b, n, s in zip(offset, out, strides, strict=True)]
        slices.append(lax.slice(x, offset, limit, strides))
    windows = jnp.stack(slices, axis=-1)
    best = jnp.argmax(windows, axis=-1) if largest else jnp.argmin(windows, axis=-1)
    k = math.prod(dims)
    return (best[..., None] == jnp.arange(k)).astype(ring.RING)
