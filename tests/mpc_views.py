"""What parties receive during MPC programs: a recording Simulator and message classification.

Shared by tests/test_mpc_privacy.py and tests/test_mpc_comm.py. `RecordingSimulator` logs every
value a party receives (after the wire codec decoded it, so exactly the payload bytes that
crossed). `classify` names what each SHUFFLE of a program moves, from the functions around it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np

import simulator.simulator as simulator_module
from mpplug.core.graph import OpKind, shuffle_sources
from mpplug.frontend.tracer import Program
from mpplug.runtime.communicator import Key
from simulator import InMemoryCommunicator, Simulator

ROUND, SEAL, KEYS, REVEAL, OTHER = "round", "seal", "keys", "reveal", "other"


@dataclass(frozen=True)
class Received:
    """One value received by party `dst` from party `src` for op `op` of execution `exec_id`."""

    exec_id: str
    op: int
    src: int
    dst: int
    value: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.value.nbytes)


class RecordingSimulator(Simulator):
    """A Simulator whose parties log every value they receive, in `received`.

    The hook is the communicator: the simulator builds one `InMemoryCommunicator` per party,
    and while this class is constructed that name is a subclass whose `recv` keeps a copy.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.received: list[Received] = []
        log, lock = self.received, threading.Lock()

        class Recording(InMemoryCommunicator):
            def recv(self, key: Key, timeout: float) -> Any:
                value = super().recv(key, timeout)
                entry = Received(key.exec_id, key.op, key.src, key.dst, np.array(value))
                with lock:
                    log.append(entry)
                return value

        with mock.patch.object(simulator_module, "InMemoryCommunicator", Recording):
            super().__init__(*args, **kwargs)

    def evaluate_recorded(self, fn: Any, *args: Any) -> tuple[Any, list[Received]]:
        """Evaluate and return the outputs with the values received during this evaluation."""
        start = len(self.received)
        out = self.evaluate(fn, *args)
        return out, self.received[start:]


def _function_name(program: Program, op_id: int) -> str:
    graph = program.graph
    op = graph.ops[op_id]
    if op.kind is OpKind.CALL:
        return graph.functions[op.function].fn_name
    return op.kind.name.lower()


def _producer(program: Program, op_id: int, src: int) -> str:
    """The function whose output party `src` sends in SHUFFLE `op_id` (through SHUFFLEs)."""
    graph = program.graph
    op = graph.ops[op_id]
    while op.kind is OpKind.SHUFFLE:
        ref = shuffle_sources(graph, op)[src]
        op = graph.ops[ref.op]
    return _function_name(program, op.id)


def _consumers(program: Program, op_id: int) -> set[str]:
    return _consumers_by_op(program).get(op_id, set())


_LAST_CONSUMERS: list[Any] = [None, {}]
"""The program `_consumers_by_op` last looked at, and what it found there."""


def _consumers_by_op(program: Program) -> dict[int, set[str]]:
    """The functions called on each op's outputs, by op, found once per program in a row
    (a privacy test classifies tens of thousands of one program's messages)."""
    if _LAST_CONSUMERS[0] is not program:
        found: dict[int, set[str]] = {}
        for op in program.graph.ops:
            if op.kind is OpKind.CALL:
                for ref in op.inputs:
                    found.setdefault(ref.op, set()).add(_function_name(program, op.id))
        _LAST_CONSUMERS[:] = [program, found]
    return _LAST_CONSUMERS[1]


def classify(program: Program, message: Received) -> str:
    """What a received value is: a protocol round's message (`round`), a seal's share pair
    (`seal`), a PRF key passed to a neighbour at setup (`keys`), a share sent to open a value
    (`reveal`), or `other`."""
    if "combine" in _consumers(program, message.op):
        return REVEAL
    producer = _producer(program, message.op, message.src)
    if producer.startswith("mpc."):
        return ROUND
    if producer == "split":
        return SEAL
    if producer == "random":
        return KEYS
    return OTHER


def of_kind(program: Program, messages: Iterable[Received], kind: str) -> list[Received]:
    return [m for m in messages if classify(program, m) == kind]


def payload(messages: Iterable[Received]) -> bytes:
    """The received bytes, concatenated in the order they arrived."""
    return b"".join(m.value.tobytes() for m in messages)


def round_depth(program: Program) -> int:
    """Communication rounds of the MPC rounds in `program`: the longest chain of round
    messages (SHUFFLEs that move an `mpc.*` function's output between parties)."""
    graph = program.graph
    depth: dict[int, int] = {}
    for op in graph.ops:
        before = max((depth[ref.op] for ref in op.inputs), default=0)
        moves = any(dst != src for dst, src in op.routes)
        is_round = (
            op.kind is OpKind.SHUFFLE
            and moves
            and _producer(
                program, op.id, next(src for dst, src in op.routes if dst != src)
            ).startswith("mpc.")
        )
        depth[op.id] = before + int(is_round)
    return max(depth.values(), default=0)


def expected_receptions(program: Program) -> dict[int, int]:
    """How many values each party receives per evaluation: one per SHUFFLE route from
    another party."""
    counts: dict[int, int] = {}
    for op in program.graph.ops:
        if op.kind is OpKind.SHUFFLE:
            for dst, src in op.routes:
                if dst != src:
                    counts[dst] = counts.get(dst, 0) + 1
    return counts
