"""The `mpplug` command: run a party, start a whole cluster here, ask parties how they are,
write development certificates, and run the demo. `main(argv)` returns the exit code.

Exit codes: 0 success, 1 a runtime failure (a party died or is not serving), 2 a usage or
configuration error, printed as one line `mpplug: error: ...` without a traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from mpplug.config import ClusterSpec, ServerLimits, TLSFiles
from mpplug.errors import ConfigError, MPPlugError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

POLL_S = 0.2
"""How often `mpplug up` checks that its parties are still running."""


class _Stop(Exception):
    """Raised in the main thread by SIGINT or SIGTERM while `mpplug up` runs."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help already
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    command: Callable[[argparse.Namespace], int] = args.command
    try:
        return command(args)
    except ConfigError as exc:
        _error(exc)
        return EXIT_USAGE
    except (MPPlugError, OSError) as exc:  # OSError: a file we could not write, say
        _error(exc)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    from mpplug import __version__

    parser = argparse.ArgumentParser(
        prog="mpplug", description="Multi-party computation over JAX: run and manage parties."
    )
    parser.add_argument("--version", action="version", version=f"mpplug {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="run one party of a cluster file in the foreground",
        description="Run one party in the foreground until SIGTERM or Ctrl-C.",
    )
    _config_arg(serve)
    serve.add_argument("--party", required=True, help="the name of the party to run")
    _server_args(serve)
    # Set by `mpplug up` and LocalParties: the party stops when that process is gone.
    serve.add_argument(
        "--custom-calls",
        metavar="ENTRIES",
        help="the custom-call targets this party compiles, comma-separated, over the cluster "
        "file's custom_calls: 'stable' (JAX's stable targets on its platform, the default), "
        "'annotations' (none but annotations) and target names",
    )
    serve.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    serve.set_defaults(command=_serve)

    up = commands.add_parser(
        "up",
        help="start every party of a cluster file on this machine",
        description="Start every party of the file as a local process, wait until each "
        "serves, print where they listen, and stop them all on Ctrl-C or SIGTERM.",
    )
    _config_arg(up)
    up.add_argument("--log-dir", help="where the parties' logs go (default: a new temp folder)")
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for every party to serve (default 120)",
    )
    _server_args(up)
    up.set_defaults(command=_up)

    status = commands.add_parser(
        "status",
        help="each party's health and open sessions",
        description="Ask every party of the file for its health, open sessions and datasets; "
        "exit 1 if any is not serving. With TLS it presents --cert/--key, else driver.pem/"
        "driver.key next to the CA, else the files of a party whose key is on this host.",
    )
    _config_arg(status)
    status.add_argument("--cert", type=Path, help="client certificate (PEM) to present")
    status.add_argument("--key", type=Path, help="the key of --cert (PEM)")
    status.add_argument("--ca", type=Path, help="the cluster CA (PEM; default: the cluster file's)")
    status.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for each party (default 3)"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object per party")
    status.set_defaults(command=_status)

    demo = commands.add_parser(
        "demo", help="the quickstart on the simulator", description="Run the quickstart."
    )
    demo.set_defaults(command=_demo)

    certs = commands.add_parser(
        "certs",
        help="write a development CA and a certificate per party",
        description="Write a development CA, one certificate per party (its host names and "
        "IPs as subject alternative names) and one for the driver into OUT, and a copy of "
        "the cluster file with tls blocks pointing at them.",
    )
    _config_arg(certs)
    certs.add_argument("--out", required=True, help="the folder to write into")
    certs.add_argument("--force", action="store_true", help="overwrite files already in OUT")
    certs.set_defaults(command=_certs)
    return parser


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="the cluster file (YAML)")


def _server_args(parser: argparse.ArgumentParser) -> None:
    """The flags that set up a party server, for `serve` and `up`."""
    _timeout_arg(parser)
    _session_idle_arg(parser)
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set one server limit, over the cluster file's `limits:` (repeatable; names: "
        f"{', '.join(f.name for f in fields(ServerLimits))})",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving without TLS on an address other hosts can reach: any of them "
        "could then act as the driver or as any party",
    )


def _timeout_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a party's send to a peer may wait (default 60)",
    )


def _session_idle_arg(parser: argparse.ArgumentParser) -> None:
    from mpplug.remote.session import DEFAULT_IDLE_TIMEOUT

    parser.add_argument(
        "--session-idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT,
        help=f"seconds a driver's session may go without a call before the party closes it "
        f"and frees its values (default {DEFAULT_IDLE_TIMEOUT:g})",
    )


def _error(exc: BaseException) -> None:
    print(f"mpplug: error: {exc}", file=sys.stderr, flush=True)


def _say(text: str = "") -> None:
    print(text, flush=True)


# -- serve ------------------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    from mpplug.remote.server import serve_party

    # config errors become our one line and exit code 2
    return serve_party(
        args.config,
        args.party,
        timeout=args.timeout,
        session_idle_timeout=args.session_idle_timeout,
        limits=args.limit,
        insecure=args.insecure,
        parent_pid=args.parent_pid,
        custom_calls=args.custom_calls,
    )


# -- up ---------------------------------------------------------------------------------------
def _up(args: argparse.Namespace) -> int:
    from mpplug.remote.launch import LocalParties
    from mpplug.remote.server import check_exposure

    spec = ClusterSpec.from_yaml(args.config)
    spec.limits.overridden(args.limit, "--limit")  # a bad one stops us before any party starts
    for name in spec.names:
        check_exposure(spec, name, insecure=args.insecure)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mpplug-up-"))
    parties = LocalParties(
        args.config,
        log_dir=log_dir,
        timeout=args.timeout,
        session_idle_timeout=args.session_idle_timeout,
        limits=args.limit,
        insecure=args.insecure,
    )
    with _StopSignals() as signals:
        try:
            _say(f"starting {spec.world_size} parties from {args.config}; logs in {log_dir}")
            parties.start()
            parties.wait_ready(args.ready_timeout)
            rows = [
                [p.name, str(rank), p.listen, p.endpoint, str(parties.processes[p.name].pid)]
                for rank, p in enumerate(spec.parties)
            ]
            _say(_table(["party", "rank", "listen", "endpoint", "pid"], rows))
            _say(f"all {spec.world_size} parties serving; Ctrl-C or SIGTERM stops them")
            while True:
                for name, process in parties.processes.items():
                    if process.poll() is not None:
                        raise MPPlugError(
                            f"party {name} exited unexpectedly with code {process.returncode}; "
                            f"stopping the others. The end of its log "
                            f"({parties.log_path(name)}):\n{parties.log(name)}"
                        )
                time.sleep(POLL_S)
        except _Stop as stop:
            _say(f"{stop}: stopping {spec.world_size} parties")
            return EXIT_OK
        finally:
            signals.disarm()
            parties.stop()
            _say("all parties stopped")


class _StopSignals:
    """While inside, the first SIGINT or SIGTERM raises `_Stop` in the main thread; later ones,
    and any after `disarm()`, are ignored so that they cannot cut a shutdown short."""

    def __init__(self) -> None:
        self._armed = True
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            self._armed = False
            raise _Stop(signal.Signals(signum).name)

    def disarm(self) -> None:
        self._armed = False

    def __enter__(self) -> _StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)


# -- status -----------------------------------------------------------------------------------
def _status(args: argparse.Namespace) -> int:
    from mpplug.remote.status import query_status

    # only the client's files need be on this host, not every party's
    spec = ClusterSpec.from_yaml(args.config, files_of=[])
    tls = _client_tls(spec, args.ca, args.cert, args.key)
    with ThreadPoolExecutor(spec.world_size) as pool:
        statuses = list(
            pool.map(lambda name: query_status(spec, name, args.timeout, tls=tls), spec.names)
        )
    if args.json:
        for rank, s in enumerate(statuses):
            record = {"party": s.name, "rank": rank, "endpoint": s.endpoint, "health": s.health}
            datasets = {name: ttype for name, ttype in s.datasets}
            _say(
                json.dumps(
                    {**record, "sessions": s.sessions, "detail": s.detail, "datasets": datasets}
                )
            )
    else:
        rows = [
            [s.name, str(rank), s.endpoint, s.health, _or_dash(s.sessions), s.detail]
            for rank, s in enumerate(statuses)
        ]
        _say(_table(["party", "rank", "endpoint", "health", "sessions", "detail"], rows))
        listed = [[s.name, name, ttype] for s in statuses for name, ttype in s.datasets]
        if listed:
            _say("")
            _say(_table(["party", "dataset", "type"], listed))
    return EXIT_OK if all(s.serving for s in statuses) else EXIT_FAILURE


def _client_tls(
    spec: ClusterSpec, ca: Path | None, cert: Path | None, key: Path | None
) -> TLSFiles | None:
    """The files `status` dials with: `cert` and `key` if given, else driver.pem/driver.key
    next to the CA, else those of the first party whose certificate and key are on this host;
    None without TLS."""
    from mpplug.remote.tls import DRIVER_CERT, DRIVER_KEY

    if (cert is None) != (key is None):
        raise ConfigError("--cert and --key go together: pass both or neither")
    if spec.parties[0].tls is None:
        if cert is not None or ca is not None:
            raise ConfigError("--ca/--cert/--key were given, but the cluster file has no tls")
        return None
    ca = ca if ca is not None else spec.parties[0].tls.ca
    if cert is not None and key is not None:
        return TLSFiles(ca, cert, key)
    candidates = [(ca.parent / DRIVER_CERT, ca.parent / DRIVER_KEY)]
    candidates += [(p.tls.cert, p.tls.key) for p in spec.parties if p.tls is not None]
    for found_cert, found_key in candidates:
        if found_cert.is_file() and found_key.is_file():
            return TLSFiles(ca, found_cert, found_key)
    raise ConfigError(
        f"the cluster uses TLS, so status needs a client certificate signed by its CA: pass "
        f"--cert and --key, or put {DRIVER_CERT} and {DRIVER_KEY} next to {ca}; no party's "
        f"certificate and key are on this host either"
    )


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    header = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    return "\n".join(line.rstrip() for line in [header, *lines])


# -- demo -------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from mpplug import demo

    demo.main()
    return EXIT_OK


# -- certs ------------------------------------------------------------------------------------
def _certs(args: argparse.Namespace) -> int:
    from mpplug.remote.certs import CA_CERT, CA_KEY, write_dev_certs
    from mpplug.remote.tls import DRIVER_CERT, DRIVER_KEY

    config: Path = args.config
    spec = ClusterSpec.from_yaml(config)
    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    out = Path(args.out)
    cluster_copy = out / config.name
    planned = [CA_CERT, CA_KEY, DRIVER_CERT, DRIVER_KEY, cluster_copy.name]
    planned += [f"{name}{suffix}" for name in spec.names for suffix in (".pem", ".key")]
    present = sorted(name for name in planned if (out / name).exists())
    if present and not args.force:
        raise ConfigError(f"{out} already holds {present}; pass --force to overwrite them")

    files = write_dev_certs(spec, out)
    for entry in raw["parties"]:
        tls = files[entry["name"]]
        entry["tls"] = {"ca": tls.ca.name, "cert": tls.cert.name, "key": tls.key.name}
    cluster_copy.write_text(
        f"# {config.name} with development TLS files from `mpplug certs`; paths are relative\n"
        f"# to this file's folder.\n" + yaml.safe_dump(raw, sort_keys=False),
        encoding="utf-8",
    )
    ClusterSpec.from_yaml(cluster_copy)  # what we wrote must load

    rows = [[f"{CA_CERT}, {CA_KEY}", f"the development CA (keep {CA_KEY} off the party hosts)"]]
    rows += [[f"{name}.pem, {name}.key", f"party {name}"] for name in spec.names]
    rows += [[f"{DRIVER_CERT}, {DRIVER_KEY}", "the driver's client certificate"]]
    rows += [[cluster_copy.name, "the cluster file with a tls block for every party"]]
    _say(f"wrote into {out}:")
    _say(_table(["files", "what"], rows))
    _say(f"use it with: mpplug serve --config {cluster_copy} --party NAME")
    return EXIT_OK
