"""A share program's emission as data: the PFunctions of its rounds and the CALL and SHUFFLE
steps that wire them, so that a traced `mp.mpc.run` is stored once and replayed into programs.

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
from mpplug.frontend.primitives import run_pfunc, shuffle_static
from mpplug.frontend.tracer import TracedValue

_MAGIC = b"MPREC001"


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


@dataclass
class Recording:
    """What `mp.mpc.run` appends to a program, and what it returns: `outputs` (value numbers)
    with their logical `metas` (shape, dtype, boolean). `streams` PRF streams were named."""

    n_inputs: int
    functions: list[PFunction] = field(default_factory=list)
    steps: list[Call | Shuffle] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    metas: list[tuple[tuple[int, ...], np.dtype[Any], bool]] = field(default_factory=list)
    streams: int = 0
    _count: int = 0

    def __post_init__(self) -> None:
        self._count = self.n_inputs + sum(
            s.results if isinstance(s, Call) else 1 for s in self.steps
        )

    def call(self, pfunc: PFunction, args: Sequence[int]) -> list[int]:
        """Record a call; returns the numbers of its results."""
        self.functions.append(pfunc)
        step = Call(len(self.functions) - 1, tuple(args), len(pfunc.outs_info))
        self.steps.append(step)
        first = self._count
        self._count += step.results
        return list(range(first, self._count))

    def shuffle(self, arg: int, sources: Sequence[int]) -> int:
        self.steps.append(Shuffle(arg, tuple(sources)))
        self._count += 1
        return self._count - 1

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
            else:
                routes: dict[int | str, int | str] = {
                    parties[d]: parties[s] for d, s in enumerate(step.sources)
                }
                values.append(shuffle_static(values[step.arg], routes))
        return [values[i] for i in self.outputs]

    def to_bytes(self) -> bytes:
        header = {
            "n_inputs": self.n_inputs,
            "steps": [
                ["call", s.function, list(s.args), s.results]
                if isinstance(s, Call)
                else ["shuffle", s.arg, list(s.sources)]
                for s in self.steps
            ],
            "outputs": self.outputs,
            "metas": [[list(shape), dtype.str, boolean] for shape, dtype, boolean in self.metas],
            "streams": self.streams,
        }
        text = json.dumps(header, separators=(",", ":")).encode()
        parts = [_MAGIC, struct.pack("<QQ", len(text), len(self.functions)), text]
        for pfunc in self.functions:
            body = pfunc.to_bytes()
            parts += [struct.pack("<Q", len(body)), body]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> Recording:
        """Parse `to_bytes()` output; ValueError (or a parse error) on anything else."""
        if data[:8] != _MAGIC:
            raise ValueError("not a share program recording")
        size, n_functions = struct.unpack_from("<QQ", data, 8)
        at = 24 + size
        header = json.loads(data[24:at])
        functions = []
        for _ in range(n_functions):
            (length,) = struct.unpack_from("<Q", data, at)
            functions.append(PFunction.from_bytes(data[at + 8 : at + 8 + length]))
            at += 8 + length
        if at != len(data):
            raise ValueError("trailing bytes after a share program recording")
        steps: list[Call | Shuffle] = [
            Call(int(s[1]), tuple(map(int, s[2])), int(s[3]))
            if s[0] == "call"
            else Shuffle(int(s[1]), tuple(map(int, s[2])))
            for s in header["steps"]
        ]
        recording = cls(
            int(header["n_inputs"]),
            functions,
            steps,
            [int(i) for i in header["outputs"]],
            [(tuple(map(int, m[0])), np.dtype(m[1]), bool(m[2])) for m in header["metas"]],
            int(header["streams"]),
        )
        recording.check()
        return recording

    def check(self) -> None:
        """Every step reads only values made before it, and calls a recorded function."""
        made = self.n_inputs
        for step in self.steps:
            reads = step.args if isinstance(step, Call) else (step.arg,)
            if any(not 0 <= i < made for i in reads):
                raise ValueError("a recorded step reads a value not made yet")
            if isinstance(step, Call):
                if not 0 <= step.function < len(self.functions):
                    raise ValueError("a recorded call names no recorded function")
                made += step.results
            else:
                made += 1
        if any(not 0 <= i < made for i in self.outputs) or len(self.metas) != len(self.outputs):
            raise ValueError("recorded outputs do not match the steps")
