"""Artifacts written and read without JAX's general serializer (`mpplug.kernels.artifact`):
what JAX reads back, what falls back to JAX, and what a corrupt buffer gets."""

from __future__ import annotations

import threading

import flatbuffers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export

from mpplug.kernels import artifact


def flat_export(fn, *specs, platforms=("cpu",)) -> jax_export.Exported:
    """`fn` exported as mp.mpc writes a round: a flat tuple of arrays in and out."""

    def flat(*args):
        out = fn(*args)
        return tuple(out) if isinstance(out, tuple) else (out,)

    return jax_export.export(jax.jit(flat), platforms=platforms)(*specs)


def spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


FLAT = {
    "no inputs": lambda: flat_export(lambda: jnp.arange(3, dtype=jnp.int32)),
    "repeated avals": lambda: flat_export(
        lambda a, b, c: (a + b, b * c, a - c), *[spec((4, 5), np.float32)] * 3
    ),
    "mixed dtypes and a scalar": lambda: flat_export(
        lambda a, b, c, d: (a.astype(np.int32) + b, c, d > 0),
        spec((7,), np.bool_),
        spec((7,), np.int32),
        spec((), np.uint8),
        spec((2, 0, 3), np.float32),
    ),
}


@pytest.mark.parametrize("name", sorted(FLAT))
def test_a_flat_function_written_here_is_what_jax_reads_back(name):
    exported = FLAT[name]()
    written = artifact.serialize(exported)
    again = jax_export.deserialize(bytearray(written))
    for field in artifact.FIELDS:
        assert getattr(again, field) == getattr(exported, field), field
    assert len(artifact.FIELDS) == 16
    assert written != bytes(exported.serialize())  # not JAX's bytes: its parts are shared
    assert artifact.serialize(exported) == written  # the same bytes every time
    assert artifact.read(bytearray(written)) == artifact.header_of(exported)


def test_repeated_parts_are_written_once():
    many = flat_export(lambda *a: a[::-1], *[spec((16, 16), np.int64)] * 12)
    assert len(artifact.serialize(many)) < 0.8 * len(bytes(many.serialize()))


def test_a_function_that_is_not_flat_is_serialized_by_jax():
    tree_in = jax_export.export(jax.jit(lambda d: d["x"] + 1))({"x": spec((3,), np.float32)})
    symbolic = jax_export.export(jax.jit(lambda a: (a * 2,)))(
        spec(jax_export.symbolic_shape("n"), np.float32)
    )
    two_platforms = flat_export(lambda a: a * 2, spec((3,), np.float32), platforms=("cpu", "cuda"))
    for exported in (tree_in, symbolic, two_platforms):
        assert artifact.serialize(exported) == bytes(exported.serialize())
    assert artifact.read(bytearray(symbolic.serialize())) is None  # JAX reads it
    header = artifact.read(bytearray(two_platforms.serialize()))
    assert header == artifact.header_of(two_platforms)
    assert header is not None and header.platforms == ("cpu", "cuda")


@pytest.mark.parametrize("name", sorted(FLAT))
def test_the_header_of_jax_s_own_bytes_is_what_jax_reads(name):
    exported = FLAT[name]()
    body = bytearray(exported.serialize())
    header = artifact.read(body)
    again = jax_export.deserialize(body)
    assert header == artifact.header_of(again)
    assert header is not None and header.mlir_module_serialized == exported.mlir_module_serialized


def test_a_check_that_fails_hands_every_artifact_to_jax(monkeypatch):
    exported = FLAT["repeated avals"]()
    monkeypatch.setattr(artifact, "_checked", threading.Event())
    monkeypatch.setattr(artifact, "_trusted", [True])
    real_write = artifact._write

    def renamed(e):  # a schema that moved on: JAX reads another name back
        return real_write(e.__class__(**{**e.__dict__, "fun_name": "other"}))

    monkeypatch.setattr(artifact, "_write", renamed)
    assert artifact.serialize(exported) == bytes(exported.serialize())
    assert artifact._trusted == [False]
    monkeypatch.setattr(artifact, "_write", real_write)
    assert artifact.serialize(exported) == bytes(exported.serialize())  # for good


def test_a_truncated_or_garbled_body_is_a_value_error_never_a_crash():
    body = artifact.serialize(FLAT["mixed dtypes and a scalar"]())
    rng = np.random.default_rng(0)
    errors = 0
    for cut in (0, 3, 8, len(body) // 2):  # the root, its vtable, the tables at the back
        with pytest.raises(ValueError):
            artifact.read(bytearray(body[:cut]))
    for _ in range(300):
        garbled = bytearray(body)
        for at in rng.integers(0, len(body), 4):
            garbled[at] = int(rng.integers(0, 256))
        try:
            artifact.read(garbled)
        except ValueError:
            errors += 1
    assert errors > 0


def shared_shape_body(avals: int, dims: int) -> bytearray:
    """An Exported whose `avals` unique avals all share one shape vector of `dims`
    dimensions: a few KiB that would read as avals * dims dimensions."""
    fb = artifact._schema
    builder = flatbuffers.Builder(1024)
    one = builder.CreateString("1")
    builder.StartVector(4, dims, 4)
    for _ in range(dims):
        builder.PrependUOffsetTRelative(one)
    shape = builder.EndVector()
    fb.AbstractValueStart(builder)
    fb.AbstractValueAddShape(builder, shape)
    aval = fb.AbstractValueEnd(builder)
    builder.StartVector(4, avals, 4)
    for _ in range(avals):
        builder.PrependUOffsetTRelative(aval)
    unique = builder.EndVector()
    fb.ExportedStart(builder)
    fb.ExportedAddSerializationVersion(builder, artifact.SERIALIZATION_VERSION)
    fb.ExportedAddNrDevices(builder, 1)
    fb.ExportedAddUniqueAvals(builder, unique)
    builder.Finish(fb.ExportedEnd(builder))
    return bytearray(builder.Output())


def test_a_body_that_shares_one_shape_among_many_avals_is_refused_at_once():
    body = shared_shape_body(avals=2000, dims=2000)
    assert len(body) < 20_000
    with pytest.raises(ValueError, match="more dimensions than"):
        artifact.read(body)
    assert artifact.read(shared_shape_body(avals=2, dims=3)) is not None  # a fair one is read


VECTOR_SLOTS = {1: 1, 3: 4, 5: 4, 7: 4, 8: 4, 9: 4, 10: 4, 11: 4, 12: 4, 13: 1, 15: 2}
VECTOR_SLOTS |= dict.fromkeys(range(19, 26), 4)
"""The Exported table's vector fields (slot: element bytes): name, avals, shardings,
platforms, effects, checks, module, kept inputs, unique avals and meshes, indices."""


@pytest.mark.parametrize("name", sorted(FLAT))
def test_what_is_written_here_is_aligned_as_flatbuffers_require(name):
    """Every table at a 4-byte boundary, every vector's length there and its elements at
    their own width: what flatbuffers' verifiers check (Python's reader does not)."""
    from jax._src.export import serialization_generated as schema

    body = bytearray(artifact.serialize(FLAT[name]()))
    root = schema.Exported.GetRootAsExported(body, 0)
    assert len(body) % 4 == 0 and root._tab.Pos % 4 == 0
    misaligned = []
    for slot, width in VECTOR_SLOTS.items():
        offset = root._tab.Offset(4 + 2 * slot)
        start = root._tab.Vector(offset) if offset else 0
        if (start - 4) % 4 or start % width:
            misaligned.append(slot)
    tables = [
        root.InTree(),
        root.OutTree(),
        *map(root.UniqueAvals, range(root.UniqueAvalsLength())),
    ]
    misaligned += [t._tab.Pos for t in tables if t._tab.Pos % 4]
    assert not misaligned
