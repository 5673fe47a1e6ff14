"""What a benchmark's header says of the machine: the party processes already running."""

from __future__ import annotations

from pathlib import Path

from bench.timing import machine_state, party_processes


def _process(proc: Path, pid: str, *argv: str) -> None:
    (proc / pid).mkdir()
    (proc / pid / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))


def test_party_processes_are_counted_by_their_command_line(tmp_path: Path):
    _process(tmp_path, "101", "python", "-m", "mpplug.remote.server", "--config", "c.yaml")
    _process(tmp_path, "102", "/venv/bin/python", "-m", "mpplug.remote.server", "--party", "P1")
    _process(tmp_path, "106", "python", "-m", "mpplug.remote.forkserver")  # or forked by one
    _process(tmp_path, "103", "python", "-m", "mpplug.remote.servers")  # another module
    _process(tmp_path, "104", "python", "bench.py", "mpplug.remote.server.log")
    _process(tmp_path, "self", "python", "-m", "mpplug.remote.server")  # not a process id
    (tmp_path / "105").mkdir()  # a process gone while the folder was read: no cmdline
    assert party_processes(tmp_path) == 3
    assert party_processes(tmp_path / "absent") is None


def test_the_header_gives_the_load_and_the_party_count():
    state = machine_state()
    assert state.startswith("load avg ") and " at start, " in state, state
    assert state.endswith(" mpplug party processes running"), state
