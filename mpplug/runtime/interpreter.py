"""`Interpreter`: runs one party's share of a Graph.

It runs the ops whose party set holds its rank through the kernel registry, moves values for
SHUFFLE ops through a Communicator, and runs COND and WHILE regions itself, with no round trip
to the driver. A plan is built once per (graph, rank).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpplug.core import PFunction, TableType, TensorType
from mpplug.core.graph import Graph, Op, OpKind, ValueRef, shuffle_sources
from mpplug.core.ops import Block
from mpplug.errors import (
    CommTimeoutError,
    ExecutionAborted,
    PartyError,
    PartyUnavailableError,
    WireError,
)
from mpplug.kernels import KernelRuntime, builtin, invoke
from mpplug.runtime.codec import payload_nbytes, received_table
from mpplug.runtime.communicator import Communicator, Key
from mpplug.runtime.profile import Recorder, Span, compile_seconds

_TRUE, _FALSE = np.array(True), np.array(False)
_TRUE.flags.writeable = _FALSE.flags.writeable = False

_DIVERGED = (
    "parties that see different values of a branch or loop predicate also wait like this: "
    "give it one value everywhere with mp.bcast or mp.mpc.reveal"
)
_PASS_THROUGH = (CommTimeoutError, ExecutionAborted, PartyUnavailableError, PartyError)


@dataclass(frozen=True, slots=True)
class _Step:
    op: Op
    args: tuple[ValueRef, ...] = ()
    sends: tuple[tuple[int, ValueRef], ...] = ()
    receive_from: int | None = None
    local: ValueRef | None = None
    fn: PFunction | None = None
    """CALL: the function to invoke."""
    regions: tuple[_Plan, ...] = ()
    counter: tuple[int, int, int] | None = None
    """WHILE counting with `mpplug.counter`: (index operand, flag operand, stop)."""
    results: tuple[ValueRef, ...] = ()
    drop: tuple[ValueRef, ...] = ()
    """Values last used by this step: freed right after it, so peak memory is the live set."""

    @property
    def uses(self) -> list[ValueRef]:
        return [*self.args, *(ref for _, ref in self.sends), *filter(None, [self.local])]


@dataclass(frozen=True, slots=True)
class _Plan:
    """One party's steps for a block (the graph or a region): which parameters it holds
    (position, where the value goes), the steps, and the block's outputs."""

    params: tuple[tuple[int, ValueRef], ...]
    steps: tuple[_Step, ...]
    outputs: tuple[ValueRef, ...]
    forwards: tuple[int | None, ...] | None = None
    """With no steps: the parameter each output is (None where not held here)."""

    @property
    def receives(self) -> bool:
        """Whether every run receives a value (and so notices an abort while it waits)."""
        return any(step.receive_from is not None for step in self.steps)


class _Frame:
    """One enclosing region instance: region `region` of op `op`, at `iteration`, inside
    `outer` (None at the top level). A loop moves its frame on (`at`) instead of making one
    per iteration; a frame is only read while its region instance runs."""

    __slots__ = ("iteration", "op", "outer", "region", "scope")

    def __init__(self, outer: _Frame | None, op: Op, region: int, iteration: int = 0) -> None:
        self.outer, self.op, self.region = outer, op, region
        self.at(iteration)

    def at(self, iteration: int) -> _Frame:
        self.iteration = iteration
        own = (self.op.id, self.region, iteration)
        self.scope: tuple[int, ...] = self.outer.scope + own if self.outer else own
        """The communicator scope of the ops inside: the enclosing frames' and this one's."""
        return self

    def __str__(self) -> str:
        if self.op.kind is OpKind.COND:
            branch = ("true", "false")[self.region]
            return f"in the {branch} branch of op %{self.op.id} (cond)"
        part = "the condition of " if self.region == 0 else ""
        return f"in {part}iteration {self.iteration} of op %{self.op.id} (while)"


def describe_op(graph: Graph, op: Op, frame: _Frame | None = None) -> str:
    """`op %3 (call jax.exec:f)`, followed by the region instances it ran in, innermost first."""
    if op.kind is OpKind.CALL:
        fn = graph.functions[op.function]
        parts = [f"op %{op.id} (call {fn.fn_type}:{fn.fn_name})"]
    else:
        parts = [f"op %{op.id} ({op.kind.name.lower()})"]
    while frame is not None:
        parts.append(str(frame))
        frame = frame.outer
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class _Run:
    """What every step of one execution needs."""

    comm: Communicator
    exec_id: str
    runtime: KernelRuntime
    timeout: float
    recorder: Recorder | None


class Interpreter:
    """One party's executable plan for one Graph."""

    def __init__(self, graph: Graph, rank: int) -> None:
        if not 0 <= rank < graph.world_size:
            raise ValueError(f"rank {rank} outside world of {graph.world_size}")
        self.graph = graph
        self.rank = rank
        self.plan = self._plan_block(graph)
        self.steps = self.plan.steps
        self.input_ops = [op for op in graph.input_ops if rank in op.parties]

    def calls(self) -> list[tuple[Op, PFunction]]:
        """The CALL ops this party runs and their PFunctions, regions' included."""
        found: list[tuple[Op, PFunction]] = []
        pending = [self.plan]
        while pending:
            for step in pending.pop(0).steps:
                if step.fn is not None:
                    found.append((step.op, step.fn))
                pending.extend(step.regions)
        return found

    def functions(self) -> list[PFunction]:
        """The PFunctions this party calls, regions' included, outer blocks first."""
        return [pfunc for _, pfunc in self.calls()]

    def _plan_block(self, block: Block) -> _Plan:
        params = tuple(
            (op.input_index, ValueRef(op.id)) for op in block.input_ops if self.rank in op.parties
        )
        planned = [s for op in block.ops if (s := self._plan_op(block, op)) is not None]
        forwards = None
        if not planned:
            held = {ref: i for i, ref in params}
            forwards = tuple(held.get(ref) for ref in block.outputs)
        return _Plan(params, _with_drops(planned, set(block.outputs)), block.outputs, forwards)

    def _plan_op(self, block: Block, op: Op) -> _Step | None:
        rank = self.rank
        if op.kind is OpKind.INPUT:
            return None
        if op.kind is OpKind.CALL:
            fn = self.graph.functions[op.function]
            return _Step(op, op.inputs, fn=fn, results=_refs(op)) if rank in op.parties else None
        if op.kind is not OpKind.SHUFFLE:
            if rank not in op.parties:
                return None
            held = tuple(dict.fromkeys(r for r in op.inputs if rank in block.holders(r)))
            regions = tuple(self._plan_block(r) for r in op.regions)
            counter = _counter(*regions) if op.kind is OpKind.WHILE else None
            if counter is not None:
                regions = (regions[0], counter[1])
                return _Step(op, held, regions=regions, counter=counter[0], results=_refs(op))
            return _Step(op, held, regions=regions, results=_refs(op))
        sources = shuffle_sources(block, op)
        sends = tuple((dst, sources[src]) for dst, src in op.routes if src == rank and dst != rank)
        mine = dict(op.routes).get(rank)
        if not sends and mine is None:
            return None
        if mine == rank:
            return _Step(op, sends=sends, local=sources[rank], results=_refs(op))
        return _Step(op, sends=sends, receive_from=mine, results=_refs(op))

    def run(
        self,
        inputs: Sequence[Any],
        comm: Communicator,
        exec_id: str,
        runtime: KernelRuntime,
        timeout: float,
        recorder: Recorder | None = None,
    ) -> list[Any]:
        """Run the plan; `inputs[i]` is argument i (None where this party holds none). With
        a `recorder`, each step is recorded in it (see mpplug.runtime.profile).

        Returns one entry per graph output: the value here, or None where not held.
        """
        for op in self.input_ops:
            if op.input_index >= len(inputs) or inputs[op.input_index] is None:
                raise PartyError(
                    self.rank,
                    describe_op(self.graph, op),
                    "MissingInput",
                    f"argument {op.input_index} ({op.outs[0]}) is not held by this party",
                )
        run = _Run(comm, exec_id, runtime, timeout, recorder)
        return self._run_block(self.plan, inputs, run, None)

    def _run_block(
        self, plan: _Plan, args: Sequence[Any], run: _Run, frame: _Frame | None
    ) -> list[Any]:
        """Run one block inside region instance `frame` (None: the top level)."""
        if plan.forwards is not None:
            return [None if i is None else args[i] for i in plan.forwards]
        env: dict[ValueRef, Any] = {ref: args[i] for i, ref in plan.params}
        runtime = run.runtime
        outs: Sequence[Any]
        for step in plan.steps:
            try:
                if run.recorder is not None:
                    outs = self._recorded(step, env, run, frame, run.recorder)
                elif step.fn is not None:
                    outs = invoke(step.fn, *[env[r] for r in step.args], runtime=runtime)
                else:
                    outs = _RUNNERS[step.op.kind](self, step, env, run, frame)
            except _PASS_THROUGH:
                raise
            except Exception as exc:
                raise PartyError(
                    self.rank,
                    describe_op(self.graph, step.op, frame),
                    type(exc).__name__,
                    str(exc),
                ) from exc
            for ref, value in zip(step.results, outs, strict=True):
                if value is not None:
                    env[ref] = value
            for ref in step.drop:
                del env[ref]
        return list(map(env.get, plan.outputs))

    def _recorded(
        self,
        step: _Step,
        env: dict[ValueRef, Any],
        run: _Run,
        frame: _Frame | None,
        recorder: Recorder,
    ) -> Sequence[Any]:
        """Run one step as `_run_block` does, recording it as an "op" span; a call also gets
        its kernel's "compile" (JAX compiling on this thread) and "run" spans."""
        op = step.op
        args = {"op": op.id, "kind": op.kind.name.lower()}
        if frame is not None:
            args["scope"] = list(frame.scope)
        start = time.time_ns()
        if step.fn is None:
            outs = _RUNNERS[op.kind](self, step, env, run, frame)
            recorder.add(_op_name(step), "op", start, **args)
            return outs
        with compile_seconds() as compiling:
            outs = invoke(step.fn, *[env[r] for r in step.args], runtime=run.runtime)
        recorder.add(_op_name(step), "op", start, **args)
        compile_ns = int(compiling[0] * 1e9)
        end = start + recorder.spans[-1].duration_ns
        if compile_ns:
            recorder.spans.append(Span(self.rank, "compile", "compile", start, compile_ns, args))
        recorder.spans.append(
            Span(self.rank, "run", "run", start + compile_ns, end - start - compile_ns, args)
        )
        return outs

    def _cond(
        self, step: _Step, env: dict[ValueRef, Any], run: _Run, frame: _Frame | None
    ) -> list[Any]:
        op = step.op
        branch = 0 if bool(env[op.inputs[0]]) else 1
        operands = [env.get(r) for r in op.inputs[1:]]
        return self._run_block(step.regions[branch], operands, run, _Frame(frame, op, branch))

    def _while(
        self, step: _Step, env: dict[ValueRef, Any], run: _Run, frame: _Frame | None
    ) -> list[Any]:
        op = step.op
        cond, body = step.regions
        operands = [env.get(r) for r in op.inputs]
        if step.counter is not None:
            return self._count(step, operands, run, frame)
        carried = len(op.outs)
        check = run.comm.check if not body.receives else None
        in_cond, in_body = _Frame(frame, op, 0), _Frame(frame, op, 1)
        iteration = 0
        while True:
            if cond.forwards is not None:  # the condition is a loop-carried flag
                keep_going = operands[cond.forwards[0]]  # type: ignore[index]
            else:
                (keep_going,) = self._run_block(cond, operands, run, in_cond.at(iteration))
            if not bool(keep_going):
                return operands[:carried]
            if check is not None:  # a loop that never receives must still stop on abort
                check(run.exec_id)
            operands[:carried] = self._run_block(body, operands, run, in_body.at(iteration))
            iteration += 1

    def _count(
        self, step: _Step, operands: list[Any], run: _Run, frame: _Frame | None
    ) -> list[Any]:
        """`_while` for a loop counted by `mpplug.counter` (see `_counter`): the interpreter
        keeps the index, so a step costs the body's own work and little else."""
        assert step.counter is not None
        op, body = step.op, step.regions[1]
        index, flag, stop = step.counter
        carried = len(op.outs)
        check = run.comm.check if not body.receives else None
        exec_id, run_body, in_body = run.exec_id, self._run_block, _Frame(frame, op, 1)
        at = int(operands[index])
        iteration = 0
        while bool(operands[flag]):
            if check is not None:  # a loop that never receives must still stop on abort
                check(exec_id)
            outs = run_body(body, operands, run, in_body.at(iteration))
            at += 1
            outs[index] = np.int32(at)
            outs[flag] = _TRUE if at < stop else _FALSE
            operands[:carried] = outs
            iteration += 1
        return operands[:carried]

    def _shuffle(
        self, step: _Step, env: dict[ValueRef, Any], run: _Run, frame: _Frame | None
    ) -> tuple[Any]:
        op, rank = step.op, self.rank
        scope = frame.scope if frame else ()
        for dst, ref in step.sends:
            if run.recorder is None:
                run.comm.send(Key(run.exec_id, op.id, rank, dst, scope), env[ref])
                continue
            start = time.time_ns()
            try:
                run.comm.send(Key(run.exec_id, op.id, rank, dst, scope), env[ref])
            finally:  # a send cut short by an abort shows how long it took too
                nbytes = payload_nbytes(env[ref])
                run.recorder.add("send", "send", start, op=op.id, to=dst, bytes=nbytes)
        if step.local is not None:
            return (env[step.local],)
        if step.receive_from is None:
            return (None,)
        key = Key(run.exec_id, op.id, step.receive_from, rank, scope)
        start = time.time_ns()
        try:
            value = run.comm.recv(key, run.timeout)
        except CommTimeoutError as exc:
            where = describe_op(self.graph, op, frame)
            if frame is not None:
                where += f"; {_DIVERGED}"
            raise CommTimeoutError(
                exc.party, exc.peer, f"{exc.key}, {where}", exc.timeout
            ) from None
        expected = op.outs[0]
        if isinstance(expected, TableType):
            value = received_table(value, expected, f"party {step.receive_from}")
        elif value.dtype != expected.dtype.numpy or value.shape != expected.shape:
            got = TensorType(value.dtype, value.shape)
            raise WireError(f"received {got} from party {step.receive_from}, expected {expected}")
        if run.recorder is not None:
            run.recorder.add(
                "recv", "recv", start, op=op.id, source=step.receive_from, bytes=value.nbytes
            )
        return (value,)


def _op_name(step: _Step) -> str:
    """How a step's span is named: the function a call runs, or the kind of op."""
    if step.fn is not None:
        return f"{step.fn.fn_type}:{step.fn.fn_name}"
    return step.op.kind.name.lower()


def _counter(cond: _Plan, body: _Plan) -> tuple[tuple[int, int, int], _Plan] | None:
    """For a loop counted by an `mpplug.counter` step (as `mp.fori_loop` traces it): the
    (index, flag, stop) the interpreter counts with instead, and the body without the step.

    Only when the condition is the carried flag, and the step's results are used nowhere
    but as the next index and flag."""
    if cond.forwards is None or cond.forwards[0] is None:
        return None
    flag = cond.forwards[0]
    params = {ref: i for i, ref in body.params}
    for step in body.steps:
        fn = step.fn
        if fn is None or fn.fn_type != builtin.COUNTER or len(step.args) != 1:
            continue
        index = params.get(step.args[0])
        stop = fn.attrs.get("stop")
        outputs = list(body.outputs)
        used = {ref for other in body.steps if other is not step for ref in other.uses}
        if (
            index is not None
            and fn.ins_info == (builtin.INDEX_TYPE,)
            and fn.outs_info == (builtin.INDEX_TYPE, builtin.FLAG_TYPE)
            and isinstance(stop, int)
            and not isinstance(stop, bool)
            and max(index, flag) < len(outputs)
            and (outputs[index], outputs[flag]) == step.results
            and all(outputs.count(ref) == 1 for ref in step.results)
            and not used & set(step.results)
        ):
            rest = tuple(s for s in body.steps if s is not step)
            return (index, flag, stop), dataclasses.replace(body, steps=rest)
    return None


_RUNNERS = {
    OpKind.SHUFFLE: Interpreter._shuffle,
    OpKind.COND: Interpreter._cond,
    OpKind.WHILE: Interpreter._while,
}


def _refs(op: Op) -> tuple[ValueRef, ...]:
    return tuple(ValueRef(op.id, i) for i in range(len(op.outs)))


def _with_drops(steps: list[_Step], keep: set[ValueRef]) -> tuple[_Step, ...]:
    """Mark on each step, made for this plan and not yet in one, the values it uses for the
    last time (outputs are kept)."""
    used_later: set[ValueRef] = set(keep)
    for step in reversed(steps):
        last = tuple(dict.fromkeys(r for r in step.uses if r not in used_later))
        used_later.update(last)
        object.__setattr__(step, "drop", last)  # frozen once planned; a copy costs 6 us
    return tuple(steps)
