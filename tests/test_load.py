"""Many sessions at once on one cluster: 16 Driver sessions on one set of real parties and 8
threads sharing one Simulator each take 50 steps, with no error, and read only their own values.
"""

from __future__ import annotations

import sys

import numpy as np

from bench.load import (
    WARMUP,
    WIDTH,
    LoadResult,
    SessionRun,
    expected,
    remote_load,
    simulator_load,
)

from .clusters import POOL

EVALUATIONS = 50


def own_value(session: int, steps: int) -> np.ndarray:
    """What `session` reads after `steps` steps: its start (session + 1) x 10^6 + [0, 1, ...]
    plus its stride session + 1 per step."""
    return (session + 1) * 1_000_000 + np.arange(WIDTH) + steps * (session + 1)


def check_sessions(result: LoadResult, sessions: int) -> None:
    assert result.first_errors() == []
    assert sorted(run.session for run in result.runs) == list(range(sessions))
    for run in result.runs:
        steps = [k for k, _ in run.results]
        assert steps == list(range(1, WARMUP + EVALUATIONS + 1)), f"session {run.session}"
        for k, value in run.results:
            assert value.dtype == np.int64 and value.shape == (WIDTH,)
            np.testing.assert_array_equal(value, own_value(run.session, k))
        assert len(run.latencies) == EVALUATIONS
    # every session was open and warmed up before any took a timed step: all ran at once
    assert max(run.ready for run in result.runs) <= min(run.began for run in result.runs)
    firsts = [int(value[0]) for run in result.runs for _, value in run.results]
    assert len(set(firsts)) == len(firsts), "two fetches read the same value"
    assert (result.errors, result.mismatches) == (0, 0)
    assert result.evaluations == sessions * EVALUATIONS


def test_sixteen_driver_sessions_on_one_party_cluster_read_only_their_own_values():
    parties = POOL.get(3)
    result = remote_load(parties.config, drivers=16, evaluations=EVALUATIONS)
    try:
        check_sessions(result, 16)
    except AssertionError:
        print(f"party logs ({parties.log_dir}):\n{parties.logs()}", file=sys.stderr)
        raise


def test_eight_threads_sharing_one_simulator_read_only_their_own_values():
    check_sessions(simulator_load(threads=8, evaluations=EVALUATIONS), 8)


def test_a_value_of_another_session_or_step_or_a_torn_one_counts_as_a_mismatch():
    torn = expected(3, 2, 4)
    torn[1] = expected(4, 2, 4)[1]
    results = (
        (1, expected(3, 1, 4)),  # its own
        (2, expected(4, 2, 4)),  # another session's
        (3, expected(3, 2, 4)),  # a stale step
        (2, torn),
    )
    run = SessionRun(3, results, (), (), 0.0, 0.0, 1.0)
    assert run.mismatches == 3
    assert LoadResult("one", (run,)).mismatches == 3
