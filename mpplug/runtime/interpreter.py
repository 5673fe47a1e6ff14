"""`Interpreter`: runs one party's share of a Graph.

It runs the ops whose party set holds its rank through the kernel registry, and moves values
for SHUFFLE ops through a Communicator. A plan is built once per (graph, rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpplug.core import TensorType
from mpplug.core.graph import Graph, Op, OpKind, ValueRef, shuffle_sources
from mpplug.errors import (
    CommTimeoutError,
    ExecutionAborted,
    PartyError,
    PartyUnavailableError,
    WireError,
)
from mpplug.kernels import KernelRuntime, invoke
from mpplug.runtime.communicator import Communicator, Key

_PASS_THROUGH = (CommTimeoutError, ExecutionAborted, PartyUnavailableError, PartyError)


@dataclass(frozen=True, slots=True)
class _Step:
    op: Op
    args: tuple[ValueRef, ...] = ()
    sends: tuple[tuple[int, ValueRef], ...] = ()
    receive_from: int | None = None
    local: ValueRef | None = None
    drop: tuple[ValueRef, ...] = ()
    """Values last used by this step: freed right after it, so peak memory is the live set."""

    @property
    def uses(self) -> list[ValueRef]:
        return [*self.args, *(ref for _, ref in self.sends), *filter(None, [self.local])]


def describe_op(graph: Graph, op: Op) -> str:
    if op.kind is OpKind.CALL:
        fn = graph.functions[op.function]
        return f"op %{op.id} (call {fn.fn_type}:{fn.fn_name})"
    return f"op %{op.id} ({op.kind.name.lower()})"


class Interpreter:
    """One party's executable plan for one Graph."""

    def __init__(self, graph: Graph, rank: int) -> None:
        if not 0 <= rank < graph.world_size:
            raise ValueError(f"rank {rank} outside world of {graph.world_size}")
        self.graph = graph
        self.rank = rank
        planned = [s for op in graph.ops if (s := self._plan(op)) is not None]
        self.steps = _with_drops(planned, set(graph.outputs))
        self.input_ops = [op for op in graph.input_ops if rank in op.parties]

    def _plan(self, op: Op) -> _Step | None:
        rank = self.rank
        if op.kind is OpKind.INPUT:
            return None
        if op.kind is OpKind.CALL:
            return _Step(op, args=op.inputs) if rank in op.parties else None
        sources = shuffle_sources(self.graph, op)
        sends = tuple((dst, sources[src]) for dst, src in op.routes if src == rank and dst != rank)
        mine = dict(op.routes).get(rank)
        if not sends and mine is None:
            return None
        if mine == rank:
            return _Step(op, sends=sends, local=sources[rank])
        return _Step(op, sends=sends, receive_from=mine)

    def run(
        self,
        inputs: Sequence[Any],
        comm: Communicator,
        exec_id: str,
        runtime: KernelRuntime,
        timeout: float,
    ) -> list[Any]:
        """Run the plan; `inputs[i]` is argument i (None where this party holds none).

        Returns one entry per graph output: the value here, or None where not held.
        """
        env: dict[ValueRef, Any] = {}
        for op in self.input_ops:
            value = inputs[op.input_index] if op.input_index < len(inputs) else None
            if value is None:
                raise PartyError(
                    self.rank,
                    describe_op(self.graph, op),
                    "MissingInput",
                    f"argument {op.input_index} ({op.outs[0]}) is not held by this party",
                )
            env[ValueRef(op.id)] = value
        rank = self.rank
        for step in self.steps:
            op = step.op
            try:
                if op.kind is OpKind.CALL:
                    fn = self.graph.functions[op.function]
                    outs = invoke(fn, *(env[r] for r in step.args), runtime=runtime)
                    for i, value in enumerate(outs):
                        env[ValueRef(op.id, i)] = value
                else:
                    self._shuffle(step, env, comm, exec_id, timeout)
            except _PASS_THROUGH:
                raise
            except Exception as exc:
                raise PartyError(
                    rank, describe_op(self.graph, op), type(exc).__name__, str(exc)
                ) from exc
            for ref in step.drop:
                del env[ref]
        return [env.get(ref) for ref in self.graph.outputs]

    def _shuffle(
        self,
        step: _Step,
        env: dict[ValueRef, Any],
        comm: Communicator,
        exec_id: str,
        timeout: float,
    ) -> None:
        op, rank = step.op, self.rank
        for dst, ref in step.sends:
            comm.send(Key(exec_id, op.id, rank, dst), env[ref])
        if step.local is not None:
            env[ValueRef(op.id)] = env[step.local]
        elif step.receive_from is not None:
            value = comm.recv(Key(exec_id, op.id, step.receive_from, rank), timeout)
            got = TensorType(value.dtype, value.shape)
            if got != op.outs[0]:
                raise WireError(
                    f"received {got} from party {step.receive_from}, expected {op.outs[0]}"
                )
            env[ValueRef(op.id)] = value


def _with_drops(steps: list[_Step], keep: set[ValueRef]) -> list[_Step]:
    """Mark on each step the values it uses for the last time (outputs are kept)."""
    used_later: set[ValueRef] = set(keep)
    marked = []
    for step in reversed(steps):
        last = tuple(dict.fromkeys(r for r in step.uses if r not in used_later))
        used_later.update(last)
        marked.append(dataclasses.replace(step, drop=last))
    return marked[::-1]
