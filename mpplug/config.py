"""Cluster configuration: the parties, where they listen, their devices, TLS files, datasets
and outputs directories.

Loaded from YAML or a dict and validated; every error names the offending field.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import re
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from mpplug.core.custom_calls import DEFAULT_POLICY, CustomCallPolicy
from mpplug.errors import ConfigError

_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,252})")
_PORT = re.compile(r"[0-9]{1,5}")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_DEVICE = re.compile(r"(cpu|cuda|rocm|tpu)(:[0-9]+)?")
_PARTY_KEYS = {
    "name",
    "endpoint",
    "listen",
    "bulk",
    "device",
    "tls",
    "data",
    "outputs",
    "custom_calls",
}
_TLS_KEYS = {"ca", "cert", "key"}
DATASET_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
"""Dataset names: no dots, slashes or spaces, so a name can never be read as a path."""
_DATASET_KEYS = {"path", "key", "dtype", "table", "columns"}
_OUTPUTS_KEYS = {"path", "overwrite"}
DATASET_FORMATS = (".npy", ".npz", ".csv")
TABLE_FORMATS = (".csv", ".parquet")
_TOP_KEYS = {"parties", "limits"}


def split_endpoint(endpoint: Any, where: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ConfigError naming `where` otherwise."""
    if not isinstance(endpoint, str):
        raise ConfigError(f"{where}: expected 'host:port' as a string, got {endpoint!r}")
    if endpoint.startswith("["):
        host, sep, port_text = endpoint[1:].partition("]:")
        if not sep:
            raise ConfigError(f"{where}: expected '[IPv6 address]:port', got {endpoint!r}")
        if not _is_ipv6(host):
            raise ConfigError(
                f"{where}: expected an IPv6 address inside the brackets, got {endpoint!r}"
            )
    else:
        host, sep, port_text = endpoint.rpartition(":")
        if not sep:
            raise ConfigError(f"{where}: expected 'host:port', got {endpoint!r} (no port)")
        if ":" in host and _is_ipv6(host):
            raise ConfigError(
                f"{where}: an IPv6 address needs brackets, as in '[::1]:50051'; got {endpoint!r}"
            )
        if not _HOST.fullmatch(host):
            raise ConfigError(
                f"{where}: expected a host name or IPv4 address before the port, got {endpoint!r}"
            )
    if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"{where}: expected a port in 1..65535, got {endpoint!r}")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, as an endpoint holds it) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for mutual TLS: the cluster CA, this party's certificate and key."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class DatasetSpec:
    """A file a party exposes under `name`: a `.npy`, one `key` of a `.npz`, or a `.csv` of
    numbers parsed as `dtype`; or, with `table`, a `.csv` (header row first) or `.parquet`
    file read as a table; a CSV table's `columns` declare kinds Arrow would otherwise guess
    (an id such as 00123 read as text, not as the number 123)."""

    name: str
    path: Path
    key: str | None = None
    dtype: str | None = None
    table: bool = False
    columns: tuple[tuple[str, str], ...] = ()

    @property
    def format(self) -> str:
        return self.path.suffix.lower()


@dataclass(frozen=True)
class OutputsSpec:
    """The directory `mp.write` writes `<name>.npy` files to; existing files are kept unless
    `overwrite`."""

    path: Path
    overwrite: bool = False


MIN_FREE_WORKERS = 8
"""Threads that executions and streams together can never hold: short calls always run."""


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one party server, from the cluster file's `limits:` block (the same for
    every party) or the command line.

    A party serves from a fixed pool of threads. Executions and streaming calls can hold a
    thread for long, so each kind has its own slots, and together they leave threads free for
    the short calls (health, Status, Abort, single-message sends): no kind of caller can
    starve another, and drivers' executions never take the threads peers need.

    - `workers`: threads serving calls; `max_rpcs`: calls at once, queued ones included
      (gRPC refuses more).
    - `sessions`: open sessions.
    - `executes`: executions running at once (Execute calls and requests on execution
      streams together).
    - `execute_streams`: ExecuteStream calls open at once; each holds a worker (and a
      reader thread of its own) while open; a driver refused one sends Execute calls.
    - `uploads`: Put and LoadProgram streams at once; `downloads`: Fetch streams at once.
    - `peer_streams`: Send streams from other parties at once.
    - `bulk_connections`: bulk connections from other parties open at once (each has a
      thread of its own, outside `workers`); one more closes the longest-idle one.
    - `stream_idle_s`: a stream that moves no message for this long is cancelled.
    - `pending_bytes_per_peer`: bytes one peer's values may take up waiting to be received
      (one value of any size is let in when none of the peer's wait).
    - `unclaimed_value_s`: values for an execution that has not started here are dropped
      this long after the first of them arrives.
    """

    workers: int = 96
    max_rpcs: int = 256
    sessions: int = 1024
    executes: int = 16
    execute_streams: int = 16
    uploads: int = 8
    downloads: int = 8
    peer_streams: int = 20
    bulk_connections: int = 32
    stream_idle_s: float = 60.0
    pending_bytes_per_peer: int = 4 << 30
    unclaimed_value_s: float = 600.0

    def __post_init__(self) -> None:
        counts = {
            "workers": self.workers,
            "max_rpcs": self.max_rpcs,
            "sessions": self.sessions,
            "executes": self.executes,
            "execute_streams": self.execute_streams,
            "uploads": self.uploads,
            "downloads": self.downloads,
            "peer_streams": self.peer_streams,
            "bulk_connections": self.bulk_connections,
            "pending_bytes_per_peer": self.pending_bytes_per_peer,
        }
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ServerLimits.{name}: expected a positive int, got {value!r}")
        for name, seconds in [
            ("stream_idle_s", self.stream_idle_s),
            ("unclaimed_value_s", self.unclaimed_value_s),
        ]:
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ConfigError(f"ServerLimits.{name}: expected seconds > 0, got {seconds!r}")
        held = (
            self.executes + self.execute_streams + self.uploads + self.downloads + self.peer_streams
        )
        if held + MIN_FREE_WORKERS > self.workers:
            raise ConfigError(
                f"ServerLimits: executes + execute_streams + uploads + downloads + peer_streams "
                f"= {held} must leave {MIN_FREE_WORKERS} of the {self.workers} workers free "
                f"for short calls"
            )
        if self.max_rpcs < self.workers:
            raise ConfigError(
                f"ServerLimits.max_rpcs: expected at least workers ({self.workers}), "
                f"got {self.max_rpcs}"
            )

    @classmethod
    def from_mapping(cls, data: Any, where: str) -> ServerLimits:
        """Limits from `name: value` pairs (the `limits:` block); unnamed ones keep their
        defaults. ConfigError naming `where` for an unknown name or a value of the wrong kind."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{where}: expected a mapping of limit names to numbers, got {data!r}"
            )
        known = {f.name: f.type for f in fields(cls)}
        unknown = _unknown(data, set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown limit(s) {unknown}; expected {sorted(known)}")
        for name, value in data.items():
            number = (int,) if known[name] == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, number):
                raise ConfigError(f"{where}.{name}: expected {known[name]}, got {value!r}")
        return cls(**data)

    def overridden(self, assignments: Sequence[str], where: str) -> ServerLimits:
        """These limits with `NAME=VALUE` assignments (the command line's) applied."""
        known = {f.name: f.type for f in fields(self)}
        changes: dict[str, Any] = {}
        for text in assignments:
            name, sep, value = text.partition("=")
            if not sep or name not in known:
                raise ConfigError(
                    f"{where}: expected NAME=VALUE with NAME one of {sorted(known)}, got {text!r}"
                )
            try:
                changes[name] = int(value) if known[name] == "int" else float(value)
            except ValueError:
                raise ConfigError(f"{where}: {name} expects {known[name]}, got {value!r}") from None
        return replace(self, **changes)

    def to_dict(self) -> dict[str, int | float]:
        """The limits that differ from the defaults, as a `limits:` block holds them."""
        default = ServerLimits()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclass(frozen=True)
class PartySpec:
    """One party: `endpoint` is what others dial, `listen` what the server binds; `data` and
    `outputs` are what programs may read and write there (by dataset name, never by path).

    `bulk`, if set, is the "host:port" other parties dial to send this party values over a
    connection of their own (mpplug.remote.bulk); the party listens for them on `listen`'s
    host at `bulk`'s port. Without it values go over gRPC.
    """

    name: str
    endpoint: str
    listen: str
    device: str | None = None
    tls: TLSFiles | None = None
    data: tuple[DatasetSpec, ...] = ()
    outputs: OutputsSpec | None = None
    bulk: str | None = None
    custom_calls: CustomCallPolicy = DEFAULT_POLICY
    """The native custom-call targets its `jax.exec` kernel compiles (see
    `mpplug.core.custom_calls`): JAX's stable targets on its platform by default."""

    @property
    def host(self) -> str:
        return split_endpoint(self.endpoint, "endpoint")[0]

    @property
    def port(self) -> int:
        return split_endpoint(self.endpoint, "endpoint")[1]

    @property
    def bulk_listen(self) -> tuple[str, int] | None:
        """The (host, port) the bulk listener binds: `listen`'s host, `bulk`'s port."""
        if self.bulk is None:
            return None
        host = split_endpoint(self.listen, "listen")[0]
        return host, split_endpoint(self.bulk, "bulk")[1]


@dataclass(frozen=True)
class ClusterSpec:
    """The parties of a cluster in rank order (rank = position in the list), and the limits
    every party's server applies."""

    parties: tuple[PartySpec, ...]
    limits: ServerLimits = field(default_factory=lambda: ServerLimits())

    @property
    def world_size(self) -> int:
        return len(self.parties)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parties]

    @property
    def tls(self) -> bool:
        return self.parties[0].tls is not None

    def rank_of(self, name: str) -> int:
        for rank, party in enumerate(self.parties):
            if party.name == name:
                return rank
        raise ConfigError(f"no party named {name!r}; parties: {self.names}")

    def party(self, name_or_rank: str | int) -> PartySpec:
        if isinstance(name_or_rank, int):
            if not 0 <= name_or_rank < self.world_size:
                raise ConfigError(f"rank {name_or_rank} outside 0..{self.world_size - 1}")
            return self.parties[name_or_rank]
        return self.parties[self.rank_of(name_or_rank)]

    @classmethod
    def from_yaml(cls, path: str | Path, *, files_of: Collection[str] | None = None) -> ClusterSpec:
        """Load and validate a cluster file; relative TLS, data and outputs paths resolve
        against its folder.

        `files_of` names the parties whose TLS files must exist on this host: None (all of
        them) suits one host or a driver beside the certificates; `mpplug serve --party X`
        passes [X], since each host keeps only its own key; [] checks none.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"cannot read cluster file {path}: {exc.strerror or type(exc).__name__}"
            ) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"cluster file {path} is not UTF-8 text: {exc.reason}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        return cls.from_dict(data, base_dir=path.parent, source=str(path), files_of=files_of)

    @classmethod
    def from_dict(
        cls,
        data: Any,
        *,
        base_dir: str | Path | None = None,
        source: str = "cluster",
        files_of: Collection[str] | None = None,
    ) -> ClusterSpec:
        """Validate a cluster given as plain data (what the YAML file holds); relative TLS
        paths resolve against `base_dir` (default: the working directory), and error
        messages start with `source`."""
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        if not isinstance(data, Mapping):
            got = "an empty document" if data is None else f"{type(data).__name__} {data!r}"
            raise ConfigError(f"{source}: expected a mapping with a 'parties' list, got {got}")
        unknown = _unknown(data, _TOP_KEYS)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown}; expected {sorted(_TOP_KEYS)}")
        if "parties" not in data:
            raise ConfigError(f"{source}: missing required key 'parties'")
        entries = data["parties"]
        if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
            raise ConfigError(
                f"{source}.parties: expected a non-empty list of parties, got {entries!r}"
            )
        parties = tuple(
            _party(entry, f"{source}.parties[{i}]", base, files_of)
            for i, entry in enumerate(entries)
        )
        _check_unique(parties, source)
        if len({p.tls is None for p in parties}) > 1:
            with_tls = [p.name for p in parties if p.tls is not None]
            without = [p.name for p in parties if p.tls is None]
            raise ConfigError(
                f"{source}.parties: either every party has a tls block or none does; "
                f"with tls: {with_tls}, without: {without}"
            )
        limits = ServerLimits.from_mapping(data.get("limits", {}), f"{source}.limits")
        return cls(parties, limits)

    @classmethod
    def local(
        cls, names: Sequence[str] | int, *, host: str = "127.0.0.1", device: str | None = None
    ) -> ClusterSpec:
        """Parties on this host at free ports (names, or a count giving P0, P1, ...), each with
        a bulk port of its own."""
        if isinstance(names, int):
            names = [f"P{i}" for i in range(names)]
        ports = free_ports(2 * len(names), host)
        parties = []
        for i, name in enumerate(names):
            endpoint, bulk = f"{host}:{ports[2 * i]}", f"{host}:{ports[2 * i + 1]}"
            parties.append(PartySpec(name, endpoint, endpoint, device, bulk=bulk))
        return cls.from_dict(
            {"parties": [_as_dict(p) for p in parties]}, source="ClusterSpec.local"
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"parties": [_as_dict(p) for p in self.parties]}
        limits = self.limits.to_dict()
        if limits:
            data["limits"] = limits
        return data


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now (all held until each is known, so
    the system cannot hand out one twice)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _as_dict(p: PartySpec) -> dict[str, Any]:
    d: dict[str, Any] = {"name": p.name, "endpoint": p.endpoint, "listen": p.listen}
    if p.bulk is not None:
        d["bulk"] = p.bulk
    if p.device is not None:
        d["device"] = p.device
    if p.tls is not None:
        d["tls"] = {"ca": str(p.tls.ca), "cert": str(p.tls.cert), "key": str(p.tls.key)}
    if p.data:
        d["data"] = {
            ds.name: {"path": str(ds.path)}
            | ({"key": ds.key} if ds.key is not None else {})
            | ({"dtype": ds.dtype} if ds.dtype is not None else {})
            | ({"table": True} if ds.table else {})
            | ({"columns": dict(ds.columns)} if ds.columns else {})
            for ds in p.data
        }
    if p.outputs is not None:
        d["outputs"] = {"path": str(p.outputs.path), "overwrite": p.outputs.overwrite}
    if p.custom_calls != DEFAULT_POLICY:
        d["custom_calls"] = list(p.custom_calls.entries)
    return d


def _party(entry: Any, where: str, base: Path, files_of: Collection[str] | None) -> PartySpec:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {entry!r}")
    unknown = _unknown(entry, _PARTY_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected {sorted(_PARTY_KEYS)}")
    for required in ("name", "endpoint"):
        if required not in entry:
            raise ConfigError(f"{where}: missing required key {required!r}")
    name = entry["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"{where}.name: expected a letter then up to 63 letters, digits, '_', '.' or '-', "
            f"got {name!r}"
        )
    endpoint = entry["endpoint"]
    host, port = split_endpoint(endpoint, f"{where}.endpoint")
    # without `listen`: every interface, or only the loopback address the endpoint names
    listen = entry.get("listen", endpoint if is_loopback(host) else f"[::]:{port}")
    listen_port = split_endpoint(listen, f"{where}.listen")[1]
    bulk = entry.get("bulk")
    if bulk is not None:
        bulk_port = split_endpoint(bulk, f"{where}.bulk")[1]
        if bulk_port in (port, listen_port):
            raise ConfigError(
                f"{where}.bulk: expected a port of its own, got {bulk!r}, the port of the "
                f"party's gRPC endpoint or listen address"
            )
    device = entry.get("device")
    if device is not None and (not isinstance(device, str) or not _DEVICE.fullmatch(device)):
        raise ConfigError(
            f"{where}.device: expected 'cpu', 'cpu:N', 'cuda:N' (or rocm/tpu), got {device!r}"
        )
    check = files_of is None or name in files_of
    tls = _tls(entry["tls"], f"{where}.tls", base, check) if entry.get("tls") is not None else None
    data = _data(entry.get("data"), f"{where}.data", base)
    outputs = _outputs(entry["outputs"], f"{where}.outputs", base) if "outputs" in entry else None
    policy = DEFAULT_POLICY
    if "custom_calls" in entry:
        try:
            policy = CustomCallPolicy.parse(entry["custom_calls"], f"{where}.custom_calls")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return PartySpec(name, endpoint, listen, device, tls, data, outputs, bulk, policy)


def _data(entry: Any, where: str, base: Path) -> tuple[DatasetSpec, ...]:
    """The `data:` section: dataset name -> a path, or a mapping with path (and key or
    dtype). Files are checked when the party starts (`mpplug.kernels.datasets`)."""
    if entry is None:
        return ()
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping of dataset names to files, got {entry!r}")
    found = []
    for name, value in entry.items():
        at = f"{where}.{name}"
        if not isinstance(name, str) or not DATASET_NAME.fullmatch(name):
            raise ConfigError(
                f"{at}: a dataset name is a letter then up to 63 letters, digits, '_' or '-', "
                f"got {name!r}"
            )
        fields = {"path": value} if isinstance(value, str) else value
        if not isinstance(fields, Mapping):
            raise ConfigError(f"{at}: expected a file path or a mapping with 'path', got {value!r}")
        unknown = _unknown(fields, _DATASET_KEYS)
        if unknown:
            raise ConfigError(f"{at}: unknown key(s) {unknown}; expected {sorted(_DATASET_KEYS)}")
        path = fields.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{at}.path: expected a file path, got {path!r}")
        table = fields.get("table", False)
        if not isinstance(table, bool):
            raise ConfigError(f"{at}.table: expected true or false, got {table!r}")
        columns = _declared_columns(fields.get("columns"), f"{at}.columns", table)
        spec = DatasetSpec(
            name, (base / path).resolve(), fields.get("key"), fields.get("dtype"), table, columns
        )
        if table:
            _check_table_format(spec, at)
        else:
            _check_format(spec, at)
        found.append(spec)
    return tuple(found)


def _declared_columns(entry: Any, at: str, table: bool) -> tuple[tuple[str, str], ...]:
    """A CSV table's `columns:` mapping, column name -> kind."""
    if entry is None:
        return ()
    from mpplug.core.types import COLUMN_KINDS

    if not table or not isinstance(entry, Mapping) or not entry:
        raise ConfigError(
            f"{at}: a table dataset may map column names to kinds ({', '.join(COLUMN_KINDS)}), "
            f"got {entry!r}"
        )
    for name, kind in entry.items():
        if not isinstance(name, str) or kind not in COLUMN_KINDS:
            raise ConfigError(
                f"{at}.{name}: expected a kind among {', '.join(COLUMN_KINDS)}, got {kind!r}"
            )
    return tuple(entry.items())


def _check_table_format(spec: DatasetSpec, at: str) -> None:
    if spec.format not in TABLE_FORMATS:
        raise ConfigError(
            f"{at}.path: a table is a {' or '.join(TABLE_FORMATS)} file, got {spec.path.name!r}"
        )
    if spec.key is not None or spec.dtype is not None:
        raise ConfigError(f"{at}: a table takes its columns from the file: no 'key' or 'dtype'")
    if spec.columns and spec.format != ".csv":
        raise ConfigError(f"{at}.columns: a .parquet file records its columns' kinds itself")


def _check_format(spec: DatasetSpec, at: str) -> None:
    if spec.format == ".parquet":
        raise ConfigError(f"{at}.table: a .parquet dataset is a table: declare 'table: true'")
    if spec.format not in DATASET_FORMATS:
        raise ConfigError(
            f"{at}.path: expected a {', '.join(DATASET_FORMATS)} file, got {spec.path.name!r}"
        )
    needs_key, needs_dtype = spec.format == ".npz", spec.format == ".csv"
    if needs_key != (spec.key is not None) or (
        spec.key is not None and not isinstance(spec.key, str)
    ):
        raise ConfigError(
            f"{at}.key: "
            + (
                "a .npz dataset names its array with 'key'"
                if needs_key
                else f"only a .npz dataset takes 'key', got {spec.key!r}"
            )
        )
    if needs_dtype != (spec.dtype is not None):
        raise ConfigError(
            f"{at}.dtype: "
            + (
                "a .csv dataset declares its element type with 'dtype'"
                if needs_dtype
                else f"only a .csv dataset takes 'dtype', got {spec.dtype!r}"
            )
        )
    if spec.dtype is not None and (not isinstance(spec.dtype, str) or spec.dtype not in CSV_DTYPES):
        raise ConfigError(f"{at}.dtype: expected one of {sorted(CSV_DTYPES)}, got {spec.dtype!r}")


CSV_DTYPES = frozenset(
    {
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)


def _outputs(entry: Any, where: str, base: Path) -> OutputsSpec:
    fields = {"path": entry} if isinstance(entry, str) else entry
    if not isinstance(fields, Mapping):
        raise ConfigError(
            f"{where}: expected a directory path or a mapping with 'path', got {entry!r}"
        )
    unknown = _unknown(fields, _OUTPUTS_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected {sorted(_OUTPUTS_KEYS)}")
    path, overwrite = fields.get("path"), fields.get("overwrite", False)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}.path: expected a directory path, got {path!r}")
    if not isinstance(overwrite, bool):
        raise ConfigError(f"{where}.overwrite: expected true or false, got {overwrite!r}")
    return OutputsSpec((base / path).resolve(), overwrite)


def _tls(entry: Any, where: str, base: Path, check: bool) -> TLSFiles:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping with ca, cert and key, got {entry!r}")
    unknown = _unknown(entry, _TLS_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected ca, cert and key")
    missing = sorted(_TLS_KEYS - set(entry))
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}; expected ca, cert and key")
    paths = {}
    for key in ("ca", "cert", "key"):
        value = entry[key]
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(f"{where}.{key}: expected a file path, got {value!r}")
        path = (base / value).resolve()
        if check and not path.is_file():
            problem = "is not a file" if path.exists() else "does not exist"
            origin = "" if Path(value).is_absolute() else f" ({str(value)!r} relative to {base})"
            raise ConfigError(f"{where}.{key}: expected a PEM file, but {path} {problem}{origin}")
        paths[key] = path
    return TLSFiles(**paths)


def _unknown(entry: Mapping[Any, Any], known: set[str]) -> list[str]:
    """The keys of `entry` outside `known`, as sorted strings (YAML keys need not be str)."""
    return sorted(str(key) for key in entry if key not in known)


def _check_unique(parties: Sequence[PartySpec], source: str) -> None:
    for attr in ("name", "endpoint"):
        seen: dict[str, int] = {}
        for rank, party in enumerate(parties):
            value = getattr(party, attr)
            if value in seen:
                raise ConfigError(
                    f"{source}.parties[{rank}].{attr}: duplicate {value!r} "
                    f"(also parties[{seen[value]}])"
                )
            seen[value] = rank
    addresses = {party.endpoint: f"parties[{rank}].endpoint" for rank, party in enumerate(parties)}
    for rank, party in enumerate(parties):
        if party.bulk is None:
            continue
        if party.bulk in addresses:
            raise ConfigError(
                f"{source}.parties[{rank}].bulk: duplicate {party.bulk!r} "
                f"(also {addresses[party.bulk]})"
            )
        addresses[party.bulk] = f"parties[{rank}].bulk"
