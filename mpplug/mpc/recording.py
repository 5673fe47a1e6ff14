"""A share program's emission as data: the PFunctions of its rounds and the CALL, SHUFFLE and
LOOP steps that wire them, so that a traced `mp.mpc.run` is stored once and replayed into
programs.

Values are numbered: the share program's inputs first, then each step's results in order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpplug.core import PFunction
from mpplug.frontend.control import fori_loop, while_loop
from mpplug.frontend.primitives import run_pfunc, shuffle_static
from mpplug.frontend.tracer import TracedValue

_MAGIC = b"MPREC002"


@dataclass(frozen=True)
class Call:
    """Run `functions[function]` at every computing party on values `args`; it makes
    `results` new values."""

    function: int
    args: tuple[int, ...]
    results: int


@dataclass(frozen=True)
class Shuffle:
    """Route value `arg` between roles: role d receives what role `sources[d]` holds."""

    arg: int
    sources: tuple[int, ...]


@dataclass(frozen=True)
class Loop:
    """Run `bodies[body]` `length` times, on (iteration, *`invariants`, *carry) with the carry
    starting at `carry` and replaced by the body's outputs; it makes the final carry.

    `length` -1 (`WHILE`): run it while the carry's second value (a bool[], the same at every
    role) is true; its first value (an int32[]) is the next iteration."""

    body: int
    invariants: tuple[int, ...]
    carry: tuple[int, ...]
    length: int


Step = Call | Shuffle | Loop

WHILE = -1
"""A `Loop`'s length when the body itself says whether to go on."""


def _results(step: Step) -> int:
    if isinstance(step, Call):
        return step.results
    if isinstance(step, Loop):
        return len(step.carry)
    return 1


@dataclass
class Recording:
    """What `mp.mpc.run` appends to a program, and what it returns: `outputs` (value numbers)
    with their logical `metas` (shape, dtype, boolean, wide). `streams` PRF streams were named.
    `bodies` are the recordings of its loops' bodies (with no metas)."""

    n_inputs: int
    functions: list[PFunction] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    metas: list[tuple[tuple[int, ...], np.dtype[Any], bool, bool]] = field(default_factory=list)
    streams: int = 0
    bodies: list[Recording] = field(default_factory=list)
    _count: int = 0

    def __post_init__(self) -> None:
        self._count = self.n_inputs + sum(_results(s) for s in self.steps)

    def call(self, pfunc: PFunction, args: Sequence[int]) -> list[int]:
        """Record a call; returns the numbers of its results."""
        self.functions.append(pfunc)
        step = Call(len(self.functions) - 1, tuple(args), len(pfunc.outs_info))
        self.steps.append(step)
        first = self._count
        self._count += step.results
        return list(range(first, self._count))

    def prepend_call(self, pfunc: PFunction) -> None:
        """Record a call of `pfunc` on no values before every step recorded so far: the steps
        that read its results, recorded before it was known, named them -1, -2, ... ."""
        self.functions.append(pfunc)
        count = len(pfunc.outs_info)
        first = self.n_inputs

        def moved(i: int) -> int:
            return first - 1 - i if i < 0 else i + count if i >= first else i

        def step_moved(step: Step) -> Step:
            if isinstance(step, Call):
                return Call(step.function, tuple(map(moved, step.args)), step.results)
            if isinstance(step, Loop):
                invariants, carry = (
                    tuple(map(moved, step.invariants)),
                    tuple(map(moved, step.carry)),
                )
                return Loop(step.body, invariants, carry, step.length)
            return Shuffle(moved(step.arg), step.sources)

        steps = [step_moved(step) for step in self.steps]
        self.steps = [Call(len(self.functions) - 1, (), count), *steps]
        self.outputs = [moved(i) for i in self.outputs]
        self._count += count

    def shuffle(self, arg: int, sources: Sequence[int]) -> int:
        self.steps.append(Shuffle(arg, tuple(sources)))
        self._count += 1
        return self._count - 1

    def loop(
        self, body: Recording, invariants: Sequence[int], carry: Sequence[int], length: int
    ) -> list[int]:
        """Record a loop of `body` (see `Loop`); returns the numbers of its results."""
        self.bodies.append(body)
        self.steps.append(Loop(len(self.bodies) - 1, tuple(invariants), tuple(carry), length))
        first = self._count
        self._count += len(carry)
        return list(range(first, self._count))

    def replay(self, inputs: Sequence[TracedValue], parties: Sequence[int]) -> list[TracedValue]:
        """Append the steps to the program being traced, on `inputs`, with role i at
        `parties[i]`; returns the program values of `outputs`."""
        if len(inputs) != self.n_inputs:
            raise ValueError(f"expected {self.n_inputs} inputs, got {len(inputs)}")
        values: list[TracedValue] = list(inputs)
        for step in self.steps:
            if isinstance(step, Call):
                args = [values[i] for i in step.args]
                values += run_pfunc(self.functions[step.function], *args, parties=list(parties))
            elif isinstance(step, Loop):
                values += self._replay_loop(step, values, parties)
            else:
                routes: dict[int | str, int | str] = {
                    parties[d]: parties[s] for d, s in enumerate(step.sources)
                }
                values.append(shuffle_static(values[step.arg], routes))
        return [values[i] for i in self.outputs]

    def _replay_loop(
        self, step: Loop, values: list[TracedValue], parties: Sequence[int]
    ) -> list[TracedValue]:
        body = self.bodies[step.body]
        invariants = [values[i] for i in step.invariants]

        start = [values[i] for i in step.carry]
        if step.length == WHILE:

            def again(carry: list[TracedValue]) -> TracedValue:
                return carry[1]

            def level(carry: list[TracedValue]) -> list[TracedValue]:
                return body.replay([carry[0], *invariants, *carry], parties)

            return list(while_loop(again, level, start))

        def iterate(i: TracedValue, carry: list[TracedValue]) -> list[TracedValue]:
            return body.replay([i, *invariants, *carry], parties)

        return list(fori_loop(0, step.length, iterate, start))

    def to_bytes(self) -> bytes:
        header = {
            "n_inputs": self.n_inputs,
            "steps": [_step_json(s) for s in self.steps],
            "outputs": self.outputs,
            "metas": [
                [list(shape), dtype.str, boolean, wide]
                for shape, dtype, boolean, wide in self.metas
            ],
            "streams": self.streams,
        }
        text = json.dumps(header, separators=(",", ":")).encode()
        parts = [_MAGIC, struct.pack("<QQQ", len(text), len(self.functions), len(self.bodies))]
        parts.append(text)
        blobs = [f.to_bytes() for f in self.functions] + [b.to_bytes() for b in self.bodies]
        for blob in blobs:
            parts += [struct.pack("<Q", len(blob)), blob]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> Recording:
        """Parse `to_bytes()` output; ValueError (or a parse error) on anything else."""
        if data[:8] != _MAGIC:
            raise ValueError("not a share program recording")
        size, n_functions, n_bodies = struct.unpack_from("<QQQ", data, 8)
        at = 32 + size
        header = json.loads(data[32:at])
        blobs = []
        for _ in range(n_functions + n_bodies):
            (length,) = struct.unpack_from("<Q", data, at)
            blobs.append(data[at + 8 : at + 8 + length])
            at += 8 + length
        if at != len(data):
            raise ValueError("trailing bytes after a share program recording")
        recording = cls(
            int(header["n_inputs"]),
            [PFunction.from_bytes(b) for b in blobs[:n_functions]],
            [_step_from_json(s) for s in header["steps"]],
            [int(i) for i in header["outputs"]],
            [
                (tuple(map(int, m[0])), np.dtype(m[1]), bool(m[2]), bool(m[3]))
                for m in header["metas"]
            ],
            int(header["streams"]),
            [cls.from_bytes(b) for b in blobs[n_functions:]],
        )
        recording.check()
        return recording

    def check(self) -> None:
        """Every step reads only values made before it, and calls a recorded function."""
        made = self.n_inputs
        for step in self.steps:
            if isinstance(step, Call):
                reads = step.args
            elif isinstance(step, Loop):
                reads = step.invariants + step.carry
            else:
                reads = (step.arg,)
            if any(not 0 <= i < made for i in reads):
                raise ValueError("a recorded step reads a value not made yet")
            if isinstance(step, Call) and not 0 <= step.function < len(self.functions):
                raise ValueError("a recorded call names no recorded function")
            if isinstance(step, Loop):
                if not 0 <= step.body < len(self.bodies):
                    raise ValueError("a recorded loop names no recorded body")
                body = self.bodies[step.body]
                if body.n_inputs != 1 + len(reads) or len(body.outputs) != len(step.carry):
                    raise ValueError("a recorded loop does not match its body")
                if step.length < WHILE or (step.length == WHILE and len(step.carry) < 2):
                    raise ValueError("a recorded loop has no valid length")
            made += _results(step)
        metas = len(self.metas) in (0, len(self.outputs))  # a loop's body has none
        if any(not 0 <= i < made for i in self.outputs) or not metas:
            raise ValueError("recorded outputs do not match the steps")


def _step_json(step: Step) -> list[Any]:
    if isinstance(step, Call):
        return ["call", step.function, list(step.args), step.results]
    if isinstance(step, Loop):
        return ["loop", step.body, list(step.invariants), list(step.carry), step.length]
    return ["shuffle", step.arg, list(step.sources)]


def _step_from_json(s: list[Any]) -> Step:
    if s[0] == "call":
        return Call(int(s[1]), tuple(map(int, s[2])), int(s[3]))
    if s[0] == "loop":
        return Loop(int(s[1]), tuple(map(int, s[2])), tuple(map(int, s[3])), int(s[4]))
    if s[0] == "shuffle":
        return Shuffle(int(s[1]), tuple(map(int, s[2])))
    raise ValueError(f"unknown recorded step {s[0]!r}")
