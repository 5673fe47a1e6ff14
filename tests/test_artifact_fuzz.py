"""Corrupted and hand-crafted `jax.export` artifacts sent to a real party process.

Each must get a typed answer (a run, or a refusal that says what is wrong); none may hang,
crash the party or escape as an untyped gRPC error, and the party serves on afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import struct
import subprocess
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export_api
from jax._src.export._export import _module_to_bytecode
from jax._src.export.serialization_generated import Exported as FlatExported
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

import mpplug as mp
from mpplug.core import PFunction
from mpplug.frontend.tracer import Program
from mpplug.protos import service_pb2 as pb
from mpplug.protos import service_pb2_grpc as rpc_pb
from mpplug.remote.driver import PARTY_SERVICE
from mpplug.remote.launch import LocalParties
from mpplug.remote.rpc import WIRE_VERSION, raw_stub, status_of
from mpplug.remote.streaming import encode_chunks, read_chunks, receive_tensor
from mpplug.runtime import codec

from .clusters import start_parties

VARIANTS_PER_ARTIFACT = 170
"""Corrupted variants of each artifact: 510 in all, less the few mutations that change no byte."""
LOAD_DEADLINE_S = 30.0
EXECUTE_DEADLINE_S = 60.0
"""Far beyond what a variant takes (well under a second): past them a variant is a hang."""
EXIT_WAIT_S = 10.0
"""How long a party whose connection dropped gets to finish exiting before it counts as up."""


# -- the valid artifacts ---------------------------------------------------------------------


ARTIFACT_SOURCE = """
import jax.numpy as jnp

def sine(a):
    return jnp.sin(a) * 2 + 1

def matmul_pair(x, y):
    return jnp.tanh(x @ y) + 1, x.sum()

def scaled_cumsum64(n):
    return jnp.cumsum(n.astype(jnp.int64) * 3)
"""
"""The functions exported, compiled from this text under a fixed file name: their bodies
record source locations, so they (and so every variant) depend on the versions of JAX and of
mpplug's exporter, not on where these lines sit in this file."""
FUNCTIONS: dict[str, Any] = {}
exec(compile(ARTIFACT_SOURCE, "artifacts.py", "exec"), FUNCTIONS)


ARTIFACTS: dict[str, tuple[Callable[..., Any], tuple[np.ndarray, ...]]] = {
    "sine": (FUNCTIONS["sine"], (np.linspace(-1, 1, 4, dtype=np.float32),)),
    "matmul_pair": (
        FUNCTIONS["matmul_pair"],
        (np.arange(9, dtype=np.float32).reshape(3, 3) / 9, np.eye(3, dtype=np.float32)),
    ),
    "scaled_cumsum64": (
        FUNCTIONS["scaled_cumsum64"],
        (np.array([1, -2, 3, 2**30, 5], dtype=np.int32),),
    ),
}


@dataclasses.dataclass(frozen=True)
class Artifact:
    """One valid one-party program calling one jax.exec PFunction, and where its StableHLO
    module lies inside the PFunction's body."""

    name: str
    program: Program
    args: tuple[np.ndarray, ...]
    expected: tuple[np.ndarray, ...]
    module: tuple[int, int]
    sections: dict[int, tuple[int, int]]
    """[start, end) in the body of each section of the module, by MLIR's section id."""

    @property
    def pfunc(self) -> PFunction:
        return self.program.graph.functions[0]

    def with_body(self, body: bytes) -> Program:
        """The same program with another body for its PFunction (the digest follows)."""
        f = self.pfunc
        pfunc = PFunction(f.fn_type, f.fn_name, body, f.ins_info, f.outs_info, f.attrs)
        return Program(dataclasses.replace(self.program.graph, functions=(pfunc,)))


def artifact(name: str) -> Artifact:
    return build_artifact(name, *ARTIFACTS[name])


_BUILT: dict[str, Artifact] = {}


def build_artifact(name: str, fn: Callable[..., Any], args: tuple[np.ndarray, ...]) -> Artifact:
    """The one-party program running `fn` on `args`, built once per name."""
    if name not in _BUILT:
        _BUILT[name] = _build(name, fn, args)
    return _BUILT[name]


def _build(name: str, fn: Callable[..., Any], args: tuple[np.ndarray, ...]) -> Artifact:
    @mp.function
    def program(*xs: mp.MPObject) -> Any:
        return mp.run_jax(fn, *xs)

    compiled = mp.compile(program, *(mp.MPObject(a, 0) for a in args), world_size=1)
    assert len(compiled.graph.functions) == 1, compiled.ir()
    with jax.enable_x64(True):
        expected = tuple(np.asarray(v) for v in jax.tree.leaves(fn(*args)))
    pfunc = compiled.graph.functions[0]
    span = module_span(pfunc)
    return Artifact(name, compiled, args, expected, span, bytecode_sections(pfunc.fn_body, span))


def module_span(pfunc: PFunction) -> tuple[int, int]:
    """[start, end) of the serialized StableHLO module inside the flatbuffer body."""
    body = bytearray(pfunc.fn_body)
    module = FlatExported.GetRootAsExported(body, 0).MlirModuleSerializedAsNumpy()
    start = module.ctypes.data - np.frombuffer(body, np.uint8).ctypes.data
    assert bytes(body[start : start + 4]) == b"ML\xefR", "not MLIR bytecode"
    return start, start + len(module)


ATTR_TYPE_OFFSET_SECTION, IR_SECTION, PROPERTIES_SECTION = 3, 4, 8
"""Ids of MLIR bytecode sections (mlir/Bytecode/Encoding.h) whose sizes and offsets the
reader follows: where single-byte changes crash it most often."""


def bytecode_sections(body: bytes, span: tuple[int, int]) -> dict[int, tuple[int, int]]:
    """The sections of the MLIR bytecode at `span` of `body`: after the magic number, the
    version and the producer string, each is an id byte (bit 7: aligned), a length and, if
    aligned, an alignment and padding."""
    module = body[span[0] : span[1]]
    _, pos = _varint(module, 4)
    pos = module.index(0, pos) + 1
    found: dict[int, tuple[int, int]] = {}
    while pos < len(module):
        code = module[pos]
        length, pos = _varint(module, pos + 1)
        if code & 0x80:
            alignment, pos = _varint(module, pos)
            pos += -pos % alignment
        found.setdefault(code & 0x7F, (span[0] + pos, span[0] + pos + length))
        pos += length
    return found


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """MLIR's prefix varint at `pos`: (value, position after it)."""
    if data[pos] == 0:
        return int.from_bytes(data[pos + 1 : pos + 9], "little"), pos + 9
    size = (data[pos] & -data[pos]).bit_length()
    return int.from_bytes(data[pos : pos + size], "little") >> size, pos + size


# -- corrupted variants ----------------------------------------------------------------------


def _flip(body: bytearray, rng: random.Random, lo: int, hi: int, count: int) -> None:
    for _ in range(count):
        body[rng.randrange(lo, hi)] ^= rng.randrange(1, 256)


def _flip_outside(body: bytearray, rng: random.Random, span: tuple[int, int], count: int) -> None:
    """Flip bytes of the flatbuffer's tables (the root, vtables, vectors), not the module's."""
    outside = [*range(0, span[0]), *range(span[1], len(body))]
    for _ in range(count):
        body[rng.choice(outside)] ^= rng.randrange(1, 256)


def _word(body: bytearray, rng: random.Random, at: int) -> None:
    """Overwrite the aligned 32-bit word at `at` (an offset or a length) with an edge value."""
    value = rng.choice([0, 1, 4, len(body), len(body) + 4, 0x7FFFFFFF, 0xFFFFFFFF])
    struct.pack_into("<I", body, at - at % 4, value)


def mutate(a: Artifact, kind: str, rng: random.Random) -> bytes:
    """One corrupted copy of `a`'s body, chosen by `kind` and `rng`."""
    body = bytearray(a.pfunc.fn_body)
    n, (start, end) = len(body), a.module
    if kind == "flip":  # one byte anywhere
        _flip(body, rng, 0, n, 1)
    elif kind == "flips":  # several bytes anywhere
        _flip(body, rng, 0, n, rng.randint(2, 16))
    elif kind == "header":  # root offset and the root table's vtable
        _flip(body, rng, 0, min(64, start), rng.randint(1, 4))
    elif kind == "tables":
        _flip_outside(body, rng, a.module, rng.randint(1, 4))
    elif kind == "word":
        _word(body, rng, rng.choice([*range(0, start - 4, 4), *range(end, n - 4, 4)]))
    elif kind == "module_length":  # the length prefix of the module's vector
        _word(body, rng, start - 4)
    elif kind == "module":  # inside the StableHLO bytecode
        _flip(body, rng, start, end, rng.choice([1, 1, 2, 4, 8]))
    elif kind == "module_head":  # magic number, version, producer, dialects
        _flip(body, rng, start, min(end, start + 48), rng.randint(1, 2))
    elif kind in SECTIONS:  # one byte of one section to an edge value
        lo, hi = a.sections[SECTIONS[kind]]
        body[rng.randrange(lo, hi)] = rng.choice([0x00, 0xFF, rng.randrange(256)])
    elif kind == "truncate":
        del body[rng.randrange(n) :]
    elif kind == "extend":
        tail = rng.choice([rng.randbytes(rng.randint(1, 4096)), bytes(64), bytes(body)])
        body += tail
    else:
        raise AssertionError(f"unknown mutation {kind!r}")
    return bytes(body)


SECTIONS = {
    "attr_type_offsets": ATTR_TYPE_OFFSET_SECTION,
    "ir": IR_SECTION,
    "properties": PROPERTIES_SECTION,
}
MUTATIONS = {
    "flip": 15,
    "flips": 10,
    "header": 10,
    "tables": 15,
    "word": 15,
    "module_length": 10,
    "module": 25,
    "module_head": 10,
    "attr_type_offsets": 15,
    "ir": 10,
    "properties": 15,
    "truncate": 10,
    "extend": 10,
}
assert sum(MUTATIONS.values()) == VARIANTS_PER_ARTIFACT


def variants(a: Artifact) -> Iterator[tuple[str, bytes]]:
    """(label, body) for every corrupted variant of `a`; the label regenerates it:
    `mutate(artifact(name), kind, random.Random(label))`."""
    for kind, count in MUTATIONS.items():
        for i in range(count):
            label = f"{a.name}/{kind}/{i}"
            body = mutate(a, kind, random.Random(label))
            if body != a.pfunc.fn_body:
                yield label, body


# -- a raw client of one party ---------------------------------------------------------------


class PartyClient:
    """One session on a one-party cluster, over the raw PartyService RPCs."""

    def __init__(self, parties: LocalParties) -> None:
        self.parties = parties
        self.spec = parties.spec
        self._channel = grpc.insecure_channel(self.spec.parties[0].endpoint)
        self._stub = rpc_pb.PartyServiceStub(self._channel)
        self._raw = raw_stub(self._channel, PARTY_SERVICE)
        self.session = uuid.uuid4().hex
        self._fetched: list[str] = []  # released with the next Execute
        self._stub.OpenSession(
            pb.OpenSessionRequest(
                session=self.session, parties=self.spec.names, wire_version=WIRE_VERSION
            ),
            timeout=LOAD_DEADLINE_S,
        )

    def close(self) -> None:
        self._channel.close()

    def put(self, name: str, array: np.ndarray) -> None:
        header = pb.PutHeader(session=self.session, name=name, type=codec.encode_type(array))
        self._raw.PutSmall(next(encode_chunks(header, array)), timeout=LOAD_DEADLINE_S)

    def load(self, program: Program) -> None:
        data = program.to_bytes()
        header = pb.ProgramHeader(session=self.session, digest=program.digest, size=len(data))
        self._raw.LoadProgram(encode_chunks(header, data), timeout=LOAD_DEADLINE_S)

    def execute(
        self, program: Program, inputs: Sequence[str], outputs: Sequence[str]
    ) -> pb.ExecuteReply:
        request = pb.ExecuteRequest(
            session=self.session,
            exec_id=uuid.uuid4().hex,
            digest=program.digest,
            inputs=inputs,
            outputs=outputs,
            timeout=EXECUTE_DEADLINE_S / 2,
            release=self._fetched,
        )
        self._fetched = []
        reply: pb.ExecuteReply = self._stub.Execute(request, timeout=EXECUTE_DEADLINE_S)
        return reply

    def fetch(self, name: str) -> np.ndarray:
        request = pb.FetchRequest(session=self.session, name=name)
        self._fetched.append(name)
        chunks = self._raw.Fetch(request.SerializeToString(), timeout=LOAD_DEADLINE_S)
        header, parts = read_chunks(chunks, pb.FetchChunk, name)
        return receive_tensor(codec.decode_type(header, name), parts, name)

    def status(self) -> pb.StatusReply:
        reply: pb.StatusReply = self._stub.Status(pb.StatusRequest(), timeout=LOAD_DEADLINE_S)
        return reply


# -- outcomes --------------------------------------------------------------------------------

RAN = "ran"
REFUSED = "refused (typed)"
UNTYPED = "untyped"
HANG = "hang"
CRASH = "crash"
FAILURES = (UNTYPED, HANG, CRASH)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one program ended on the party: its output values if it ran, else what it said."""

    kind: str
    detail: str = ""
    error_type: str = ""
    values: tuple[np.ndarray, ...] = ()


def _untyped(details: str) -> bool:
    return not details or "Exception calling application" in details


def run_variant(client: PartyClient, a: Artifact, program: Program, tag: str) -> Outcome:
    """Load and run `program` (a's program with some body) on the party; how it ended."""
    try:
        client.load(program)
    except grpc.RpcError as exc:
        return _rpc_outcome(client, exc, "LoadProgram")
    inputs = [f"{a.name}-in{i}" for i in range(len(a.args))]
    outputs = [f"{tag}-out{i}" for i in range(len(a.expected))]
    try:
        reply = client.execute(program, inputs, outputs)
        if reply.WhichOneof("outcome") == "completed":
            return Outcome(RAN, values=tuple(client.fetch(name) for name in outputs))
    except grpc.RpcError as exc:
        return _rpc_outcome(client, exc, "Execute")
    return _reply_outcome(reply, program)


def _rpc_outcome(client: PartyClient, exc: grpc.RpcError, method: str) -> Outcome:
    code, details = status_of(exc)
    if code is grpc.StatusCode.UNAVAILABLE:  # a dropped connection: is the party exiting?
        _await_exit(client.parties, EXIT_WAIT_S)
    if not client.parties.alive():
        codes = {n: p.returncode for n, p in client.parties.processes.items()}
        return Outcome(CRASH, f"{method}: the party exited {codes} ({code.name}: {details})")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return Outcome(HANG, f"{method}: no answer before the deadline")
    if method == "LoadProgram" and code is grpc.StatusCode.INVALID_ARGUMENT and details:
        return Outcome(REFUSED, details, "INVALID_ARGUMENT from LoadProgram")
    return Outcome(UNTYPED, f"{method}: {code.name}: {details}")


def _await_exit(parties: LocalParties, seconds: float) -> None:
    for process in parties.processes.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(seconds)


def _reply_outcome(reply: pb.ExecuteReply, program: Program) -> Outcome:
    """A failed Execute is typed when it is a PartyError that names its error and, for a
    refused body, the PFunction and its digest."""
    if reply.WhichOneof("outcome") != "party_error":
        return Outcome(UNTYPED, f"Execute replied {reply}")
    failure = reply.party_error
    pfunc = program.graph.functions[0]
    named = f"PFunction {pfunc.fn_name!r} ({pfunc.digest[:12]})"
    if _untyped(failure.message) or not failure.error_type:
        return Outcome(UNTYPED, f"Execute: {failure}")
    if failure.error_type == "InvalidPFunctionError" and not failure.message.startswith(named):
        return Outcome(UNTYPED, f"Execute: the refusal does not name {named}: {failure.message}")
    return Outcome(REFUSED, failure.message, failure.error_type)


# -- the party -------------------------------------------------------------------------------


class Party:
    """A one-party cluster of its own (a crash must not take down a pooled one), restarted
    when a variant crashes it."""

    def __init__(self, workdir: Path) -> None:
        self.parties = start_parties(workdir, 1)
        try:
            self.client = PartyClient(self.parties)
        except BaseException:
            self.parties.stop(grace=0.0)
            raise

    def restart(self) -> None:
        self.client.close()
        self.parties.stop(grace=0.0)
        self.parties.start()
        self.parties.wait_ready(timeout=120.0)
        self.client = PartyClient(self.parties)

    def put_inputs(self, a: Artifact) -> None:
        for i, arg in enumerate(a.args):
            self.client.put(f"{a.name}-in{i}", arg)

    def stop(self) -> None:
        self.client.close()
        self.parties.stop(grace=0.0)


@pytest.fixture(scope="module")
def party(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Party]:
    party = Party(tmp_path_factory.mktemp("artifact-fuzz"))
    try:
        yield party
    finally:
        party.stop()


def assert_serves(party: Party, a: Artifact) -> tuple[np.ndarray, ...]:
    """The party is up, answers Status and runs `a`'s valid program to the right answer,
    which it returns (as this party computes it, to the last bit)."""
    assert party.parties.alive(), party.parties.logs()
    status = party.client.status()
    assert (status.party, status.world_size) == ("P0", 1)
    party.put_inputs(a)
    outcome = run_variant(party.client, a, a.program, f"valid-{uuid.uuid4().hex}")
    assert outcome.kind == RAN, outcome
    for value, expected in zip(outcome.values, a.expected, strict=True):
        assert value.dtype == expected.dtype
        np.testing.assert_allclose(value, expected, rtol=1e-6)
    return outcome.values


@dataclasses.dataclass
class FuzzResult:
    """What the variants of one artifact got: counts by outcome (and by refusing check), and
    the label and outcome of each failure."""

    name: str
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    refusals: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failures: list[tuple[str, Outcome]] = dataclasses.field(default_factory=list)

    @property
    def variants(self) -> int:
        return sum(self.counts[kind] for kind in (RAN, REFUSED, *FAILURES))

    def summary(self) -> str:
        counts = self.counts
        refusals = ", ".join(f"{n} {stage}" for stage, n in sorted(self.refusals.items()))
        return (
            f"artifact fuzz [{self.name}]: {self.variants} variants, {counts[RAN]} ran "
            f"({counts['different']} with a different result), {counts[REFUSED]} refused "
            f"(typed: {refusals or 'none'}), {counts[UNTYPED]} untyped, {counts[HANG]} hangs, "
            f"{counts[CRASH]} crashes"
        )


def fuzz(party: Party, a: Artifact, cases: Iterator[tuple[str, bytes]]) -> FuzzResult:
    """Run every (label, body) case against the party, restarting it after a crash."""
    reference = assert_serves(party, a)
    result = FuzzResult(a.name)
    for i, (label, body) in enumerate(cases):
        outcome = run_variant(party.client, a, a.with_body(body), f"v{i}")
        result.counts[outcome.kind] += 1
        if outcome.kind == RAN and not all(
            np.array_equal(v, r) for v, r in zip(outcome.values, reference, strict=True)
        ):
            result.counts["different"] += 1
        if outcome.kind == REFUSED:
            result.refusals[refusal_stage(outcome)] += 1
        if outcome.kind in FAILURES:
            result.failures.append((label, outcome))
        if outcome.kind == CRASH:
            party.restart()
            party.put_inputs(a)
    return result


STAGES = {
    "is not a jax.export artifact": "flatbuffer check",
    "serialization version": "flatbuffer check",
    "does not deserialize": "jax.export.deserialize",
    "calling convention": "calling convention check",
    "exported for platforms": "platform check",
    "declares (": "type check",
    "unsupported ins_info": "type check",
    "unsupported outs_info": "type check",
    "StableHLO module": "StableHLO module",
    "holds a module that does not load": "StableHLO module",
}
"""Which of the kernel's checks refused a body, by a fragment of its message."""


def refusal_stage(outcome: Outcome) -> str:
    """ "InvalidPFunctionError at <stage>" for the kernel's refusals, else the error type."""
    if outcome.error_type != "InvalidPFunctionError":
        return outcome.error_type
    stage = next((s for key, s in STAGES.items() if key in outcome.detail), "another check")
    return f"{outcome.error_type} at {stage}"


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARTIFACTS))
def test_every_corrupted_artifact_gets_a_typed_answer(party: Party, name: str) -> None:
    a = artifact(name)
    result = fuzz(party, a, variants(a))
    print(result.summary())
    assert result.variants >= VARIANTS_PER_ARTIFACT - 5, result.counts  # a few are no-ops
    assert result.counts[REFUSED] > VARIANTS_PER_ARTIFACT / 2, result.summary()
    assert not result.failures, (
        f"{result.summary()}\nregenerate a case with "
        f"mutate(artifact(name), kind, random.Random(label)):\n"
        + "\n".join(f"{label}: {o.kind}: {o.detail[:500]}" for label, o in result.failures)
    )
    assert_serves(party, a)


# -- hand-crafted modules: custom calls ------------------------------------------------------


def host_callback_module() -> ir.Module:
    """What `jax.pure_callback` lowers to on CPU: a custom call into the calling process's
    Python (JAX refuses to export it; a driver can still write the module itself)."""

    def callback(a: jax.Array) -> jax.Array:
        return jax.pure_callback(np.negative, jax.ShapeDtypeStruct(a.shape, a.dtype), a)

    spec = jax.ShapeDtypeStruct((4,), np.float32)
    module = jax.jit(callback).lower(spec).compiler_ir("stablehlo")
    assert isinstance(module, ir.Module)
    return module


def _parsed(text: str) -> Callable[[], ir.Module]:
    return lambda: ir.Module.parse(text)


_MODULE = "module @jit_f attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}"
CRAFTED: dict[str, tuple[str, Callable[[], ir.Module], Callable[..., Any], np.ndarray]] = {
    "host_callback": (
        "xla_ffi_python_cpu_callback",
        host_callback_module,
        jnp.negative,
        np.arange(4, dtype=np.float32),
    ),
    # A target JAX itself emits (jnp.linalg.inv), with a result smaller than LAPACK writes.
    "lapack_inconsistent_shapes": (
        "lapack_sgetrf_ffi",
        _parsed(
            _MODULE
            + """ {
  func.func public @main(%arg0: tensor<64x64xf32>) -> (tensor<2x2xf32>) {
    %0:3 = stablehlo.custom_call @lapack_sgetrf_ffi(%arg0) {api_version = 4 : i32,
      backend_config = {}, operand_layouts = [dense<[0, 1]> : tensor<2xindex>],
      result_layouts = [dense<[0, 1]> : tensor<2xindex>, dense<0> : tensor<1xindex>,
                        dense<> : tensor<0xindex>]}
      : (tensor<64x64xf32>) -> (tensor<2x2xf32>, tensor<1xi32>, tensor<i32>)
    return %0#0 : tensor<2x2xf32>
  }
}"""
        ),
        lambda a: a[:2, :2],
        np.eye(64, dtype=np.float32),
    ),
    "unknown_target": (
        "no_such_target",
        _parsed(
            _MODULE
            + """ {
  func.func public @main(%arg0: tensor<4xf32>) -> (tensor<4xf32>) {
    %0 = stablehlo.custom_call @no_such_target(%arg0) {api_version = 4 : i32,
      backend_config = {}} : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}"""
        ),
        jnp.negative,
        np.arange(4, dtype=np.float32),
    ),
}


def crafted_artifact(name: str) -> Artifact:
    """A valid program whose one PFunction carries the crafted module `name` in place of the
    export of a function with the same signature."""
    _, make_module, like, arg = CRAFTED[name]
    template = build_artifact(f"crafted-{name}", like, (arg,))
    exported = jax_export_api.deserialize(bytearray(template.pfunc.fn_body))
    with mlir.make_ir_context():
        module = _module_to_bytecode(make_module())
    body = bytes(dataclasses.replace(exported, mlir_module_serialized=module).serialize())
    program = template.with_body(body)
    span = module_span(program.graph.functions[0])
    sections = bytecode_sections(body, span)
    return dataclasses.replace(template, program=program, module=span, sections=sections)


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_custom_call_is_refused_and_the_party_serves_on(party: Party, name: str) -> None:
    target = CRAFTED[name][0]
    a = crafted_artifact(name)
    party.put_inputs(a)
    outcome = run_variant(party.client, a, a.program, f"crafted-{name}")
    if outcome.kind == CRASH:
        party.restart()
    assert outcome.kind == REFUSED, outcome
    assert target in outcome.detail, outcome
    assert_serves(party, artifact("sine"))
