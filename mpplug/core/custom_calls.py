"""Which StableHLO custom-call targets a party compiles: its policy, and the refusal that
names a target, the JAX function it likely came from and the setting that admits it.

A custom call is native code (LAPACK, cuSOLVER, a JAX FFI kernel) run on buffers whose shapes
only the module declares, so a party compiles only targets it chose. The default is the set
`jax.export` itself accepts: the targets JAX guarantees stable across versions, on the party's
platform, less those that run code the program supplies (Pallas' `tpu_custom_call` and
`mosaic_gpu_v2`) or another runtime (`tf.call_tf_function`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ANNOTATIONS = frozenset(
    {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"}
)
"""Targets that only annotate (no code runs): every policy admits them."""

NOT_BY_DEFAULT = frozenset({"tpu_custom_call", "mosaic_gpu_v2", "tf.call_tf_function"})
"""Stable targets that run program-supplied kernels or TensorFlow: admitted only by name."""

STABLE = "stable"
"""Policy entry: every target JAX guarantees stable for export, on the party's platform."""
ONLY_ANNOTATIONS = "annotations"
"""Policy entry: the annotations alone (they are always admitted)."""

_PLATFORM_PREFIXES = (
    ("lapack_", "cpu"),
    ("ducc_", "cpu"),
    ("cu_", "cuda"),
    ("cusolver_", "cuda"),
    ("cusparse_", "cuda"),
    ("cublas", "cuda"),
    ("mosaic_gpu", "cuda"),
    ("hip_", "rocm"),
    ("hipsolver_", "rocm"),
    ("hipsparse_", "rocm"),
    ("tpu_", "tpu"),
)

_ORIGINS = (
    (r"potrf", "jnp.linalg.cholesky (or jax.scipy.linalg.cho_factor)"),
    (r"geqrf|orgqr|ungqr|Qr$|Householder", "jnp.linalg.qr"),
    (r"gesdd|gesvd", "jnp.linalg.svd (or pinv, lstsq, matrix_rank, norm(ord=2))"),
    (r"syevd|heevd|sytrd|hetrd|Eigh", "jnp.linalg.eigh (or eigvalsh)"),
    (r"geev", "jnp.linalg.eig (or eigvals)"),
    (r"gees|gehrd", "jax.scipy.linalg.schur (or sqrtm, funm)"),
    (
        r"getrf|LuDecomposition|lu_pivots",
        "jnp.linalg.solve, inv, det, slogdet or jax.scipy.linalg.lu (and expm)",
    ),
    (r"trsm", "jax.scipy.linalg.solve_triangular (lax.linalg.triangular_solve)"),
    (r"gtsv", "lax.linalg.tridiagonal_solve"),
    (r"threefry", "jax.random (threefry on the GPU)"),
    (r"ducc_fft|fft", "jnp.fft"),
    (r"top_k|TopK", "lax.top_k or lax.approx_max_k"),
)


def stable_targets() -> frozenset[str]:
    """The custom-call targets this JAX guarantees stable for `jax.export` (the set its
    export accepts without `disabled_checks`)."""
    from jax._src.export import _export

    return frozenset(_export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE)


def target_platform(target: str) -> str | None:
    """The platform whose kernels a target names, or None for every platform."""
    for prefix, platform in _PLATFORM_PREFIXES:
        if target.startswith(prefix):
            return platform
    return None


def likely_origin(target: str) -> str | None:
    """The JAX function a target most likely came from, where that can be told."""
    for pattern, origin in _ORIGINS:
        if re.search(pattern, target):
            return origin
    return None


def runs_on(targets: Iterable[str], platform: str) -> list[str]:
    """The targets that can run on `platform`: its own and the platform-neutral ones."""
    return [t for t in targets if target_platform(t) in (None, platform)]


class CustomCallRefused(Exception):
    """A module calls custom-call targets the policy does not admit."""


@dataclass(frozen=True)
class CustomCallPolicy:
    """A party's admitted targets: `entries` are target names and the groups `stable` and
    `annotations`; the annotations are always admitted."""

    entries: tuple[str, ...] = (STABLE,)

    @classmethod
    def parse(cls, value: object, where: str) -> CustomCallPolicy:
        """A policy from a cluster file or command line value: a list of entries, or one
        string of comma-separated entries; ValueError naming `where` otherwise."""
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple) or not value:
            raise ValueError(
                f"{where}: expected a non-empty list of custom-call targets (or "
                f"{STABLE!r}, {ONLY_ANNOTATIONS!r}), got {value!r}"
            )
        bad = [v for v in value if not isinstance(v, str) or not re.fullmatch(r"[\w.$-]+", v)]
        if bad:
            raise ValueError(f"{where}: expected custom-call target names, got {bad[0]!r}")
        return cls(tuple(dict.fromkeys(value)))

    def admitted(self, platform: str) -> frozenset[str]:
        """The targets admitted for a party on `platform` ("cpu", "cuda", "rocm", "tpu")."""
        return _admitted(self.entries, platform)

    def setting(self) -> str:
        """How the policy reads in a cluster file."""
        return f"custom_calls: [{', '.join(self.entries)}]"

    def check(self, targets: Iterable[str], platform: str, where: str) -> None:
        """CustomCallRefused (naming the first target refused, its likely origin and the
        setting that admits it) unless every target in `targets` that can run on `platform`
        is admitted. A module exported for several platforms holds each one's kernels; XLA
        finds no other platform's kernel on this one (it registers kernels per platform)."""
        refused = sorted(set(runs_on(targets, platform)) - self.admitted(platform))
        if refused:
            raise CustomCallRefused(self.refusal(refused, platform, where))

    def refusal(self, refused: Sequence[str], platform: str, where: str) -> str:
        target = refused[0]
        origin = likely_origin(target)
        others = f" (and {', '.join(map(repr, refused[1:]))})" if refused[1:] else ""
        widened = ", ".join(dict.fromkeys([*self.entries, *refused]))
        return (
            f"{where} calls custom_call target {target!r}{others}"
            f"{f', most likely from {origin}' if origin else ''}, native code this party's "
            f"policy ({self.setting()}, on {platform}) does not admit; a party "
            f"admits it with custom_calls: [{widened}] in its cluster file entry (mpplug "
            f"serve --custom-calls {widened.replace(' ', '')}), or mp.Simulator(custom_calls="
            f"[...]) in the Simulator"
        )


DEFAULT_POLICY = CustomCallPolicy()


@functools.cache
def _admitted(entries: tuple[str, ...], platform: str) -> frozenset[str]:
    """`CustomCallPolicy.admitted`, worked out once per policy and platform (every artifact a
    party loads asks)."""
    allowed = set(ANNOTATIONS)
    for entry in entries:
        if entry == STABLE:
            allowed |= {
                t
                for t in stable_targets() - NOT_BY_DEFAULT
                if target_platform(t) in (None, platform)
            }
        elif entry != ONLY_ANNOTATIONS:
            allowed.add(entry)
    return frozenset(allowed)


_TARGET = re.compile(r"stablehlo\.custom_call @([\w.$-]+)|call_target_name = \"([^\"]+)\"")


def module_targets(exported: object) -> tuple[str, ...]:
    """The custom-call targets in a trusted `jax.export.Exported`'s module (parsed in this
    process: only for artifacts this process made or trusts)."""
    if b"custom_call" not in bytes(exported.mlir_module_serialized):  # type: ignore[attr-defined]
        return ()  # the bytecode names every op kind it holds
    text = exported.mlir_module()  # type: ignore[attr-defined]
    return tuple(sorted({a or b for a, b in _TARGET.findall(text)}))


# -- buffer shapes of the native kernels a party admits from untrusted programs ---------------

Tensor = tuple[tuple[int, ...], str]
"""A custom call's operand or result: shape and MLIR element type ("f32", "complex<f64>")."""


@dataclass(frozen=True)
class CustomCall:
    """One custom call of a module, as the module check read it."""

    target: str
    operands: tuple[Tensor, ...]
    results: tuple[Tensor, ...]
    mode: int | None = None
    """The `mode` backend attribute (gesdd's job: ord('A'), ord('S') or ord('N'))."""


_LAPACK = re.compile(r"lapack_([sdcz])([a-z]+)_ffi$")
_SOLVER = re.compile(r"(?:cusolver|hipsolver)_([a-z]+)_ffi$")
_REAL = {"f32": "f32", "f64": "f64", "complex<f32>": "f32", "complex<f64>": "f64"}
_LETTER = {"s": "f32", "d": "f64", "c": "complex<f32>", "z": "complex<f64>"}
_COMPLEX = {"f32": "complex<f32>", "f64": "complex<f64>"}


def _solver_results(routine: str, call: CustomCall, main: str) -> list[Tensor] | None:
    """The results JAX's lowering gives a LAPACK-style routine on `call`'s operands (None:
    not a routine known here). Each kernel writes as much as these shapes hold."""
    (a, a_type), *rest = call.operands
    if len(a) < 2 or a_type != main:
        return None
    *batch, m, n = a
    b, k, real = tuple(batch), min(m, n), _REAL[main]
    info = (b, "i32")
    square = m == n
    if routine == "potrf" and square:
        return [(a, main), info]
    if routine == "getrf":
        return [(a, main), ((*b, k), "i32"), info]
    if routine == "geqrf":
        return [(a, main), ((*b, k), main)]
    if routine in ("orgqr", "ungqr") and len(rest) == 1 and rest[0][1] == main:
        tau = rest[0][0]
        if tau[:-1] == b and len(tau) == len(b) + 1 and tau[-1] <= n <= m:
            return [(a, main)]
        return None
    if routine in ("syevd", "heevd") and square:
        return [(a, main), ((*b, n), real), info]
    if routine in ("sytrd", "hetrd") and square and n >= 1:
        return [(a, main), ((*b, n), real), ((*b, n - 1), real), ((*b, n - 1), main), info]
    if routine == "gehrd" and square and n >= 1:
        return [(a, main), ((*b, n - 1), main), info]
    if routine in ("gesdd", "gesvd", "gesvdj"):
        reduced = call.mode == ord("S")
        u, vt = ((*b, m, k), (*b, k, n)) if reduced else ((*b, m, m), (*b, n, n))
        return [(a, main), ((*b, k), real), (u, main), (vt, main), info]
    if routine == "geev" and square:
        vectors = ((*b, n, n), _COMPLEX.get(main, main))
        values = [((*b, n), main)] if main.startswith("complex") else [((*b, n), main)] * 2
        return [*values, vectors, vectors, info]
    if routine == "gees" and square:
        values = [((*b, n), main)] if main.startswith("complex") else [((*b, n), main)] * 2
        return [(a, main), (a, main), *values, info, info]
    if routine == "trsm" and square and len(rest) == 1:
        (rhs, rhs_type) = rest[0]
        if rhs_type == main and len(rhs) == len(a) and rhs[:-2] == b and m in rhs[-2:]:
            return [(rhs, main)]
        return None
    return None


def _gtsv_results(call: CustomCall, main: str) -> list[Tensor] | None:
    if len(call.operands) != 4:
        return None
    (dl, t1), (d, t2), (du, t3), (rhs, t4) = call.operands
    same = dl == d == du and len(rhs) == len(dl) + 1 and rhs[:-1] == dl
    if not same or {t1, t2, t3, t4} != {main}:
        return None
    return [*call.operands, (dl[:-1], "i32")]


def expected_results(call: CustomCall) -> list[Tensor] | None:
    """What JAX's lowering gives `call.target` on `call.operands`, for the native kernels a
    party checks; None for one it does not know (or operands JAX never gives it)."""
    if (found := _LAPACK.match(call.target)) is not None:
        letter, routine = found.groups()
        if routine == "gtsv":
            return _gtsv_results(call, _LETTER[letter])
        return _solver_results(routine, call, _LETTER[letter])
    if (found := _SOLVER.match(call.target)) is not None and call.operands:
        main = call.operands[0][1]
        return _solver_results(found.group(1), call, main) if main in _REAL else None
    if call.target in ("cu_threefry2x32_ffi", "hip_threefry2x32_ffi"):
        shapes = {shape for shape, _ in call.operands}
        if (
            len(call.operands) == 4
            and len(shapes) == 1
            and {t for _, t in call.operands} == {"ui32"}
        ):
            return [call.operands[2], call.operands[3]]
        return None
    if call.target in ("cu_lu_pivots_to_permutation", "hip_lu_pivots_to_permutation"):
        if len(call.operands) == 1 and len(call.results) == 1:
            (pivots, kind), (perm, perm_kind) = call.operands[0], call.results[0]
            ok = kind == perm_kind == "i32" and perm[:-1] == pivots[:-1] and len(perm) >= 1
            return [call.results[0]] if ok and perm[-1] >= pivots[-1] else None
        return None
    return None


SHAPE_CHECKED_ELSEWHERE = ANNOTATIONS | {
    "AllocateBuffer",
    "ApproxTopK",
    "shape_assertion",
    "stablehlo.dynamic_approx_top_k",
    "stablehlo.dynamic_reduce_window",
    "stablehlo.dynamic_rng_bit_generator",
    "stablehlo.dynamic_top_k",
}
"""Admitted targets that run no kernel on buffers the module sizes: annotations, and ops XLA
expands itself (with its own shape checks)."""


def check_buffers(call: CustomCall, where: str, vouched: Iterable[str] = ()) -> None:
    """CustomCallRefused unless `call`'s results are exactly what JAX's lowering gives its
    target on its operands: a native kernel writes what its operands imply, so smaller
    result buffers would be written past. A target with no such rule here is refused from
    an untrusted program unless XLA checks it (`SHAPE_CHECKED_ELSEWHERE`) or the party's
    policy names it (`vouched`: a site's own kernel, which must check its buffers itself)."""
    if call.target in SHAPE_CHECKED_ELSEWHERE:
        return
    expected = expected_results(call)
    if expected is None and call.target in set(vouched):
        return
    if expected is None:
        raise CustomCallRefused(
            f"{where} calls custom_call target {call.target!r} on operands "
            f"{_describe(call.operands)}, which JAX's lowering never gives it (or a target "
            f"whose buffers this party cannot check)"
        )
    if [tuple(r) for r in call.results] != [(tuple(s), t) for s, t in expected]:
        raise CustomCallRefused(
            f"{where} calls custom_call target {call.target!r} with results "
            f"{_describe(call.results)} on operands {_describe(call.operands)}; JAX's lowering "
            f"gives {_describe(expected)}, and the kernel would write past smaller buffers"
        )


def _describe(tensors: Sequence[Tensor]) -> str:
    return "(" + ", ".join(f"{t}[{','.join(map(str, s))}]" for s, t in tensors) + ")"
