"""Cluster configuration: the parties, where they listen, their devices and TLS files.

Loaded from YAML or a dict and validated; every error names the offending field.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mpplug.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_DEVICE = re.compile(r"^(cpu|cuda|rocm|tpu)(:\d+)?$")
_PARTY_KEYS = {"name", "endpoint", "listen", "device", "tls"}
_TLS_KEYS = {"ca", "cert", "key"}
_TOP_KEYS = {"parties"}


def split_endpoint(endpoint: str, where: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ConfigError naming `where` otherwise."""
    if not isinstance(endpoint, str):
        raise ConfigError(f"{where}: expected 'host:port', got {endpoint!r}")
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\s\[\]]+):(\d+)", endpoint)
    if match is None:
        raise ConfigError(f"{where}: expected 'host:port', got {endpoint!r}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port must be in 1..65535, got {port}")
    return host, port


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for mutual TLS: the cluster CA, this party's certificate and key."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class PartySpec:
    """One party: `endpoint` is what others dial, `listen` what the server binds."""

    name: str
    endpoint: str
    listen: str
    device: str | None = None
    tls: TLSFiles | None = None

    @property
    def host(self) -> str:
        return split_endpoint(self.endpoint, "endpoint")[0]

    @property
    def port(self) -> int:
        return split_endpoint(self.endpoint, "endpoint")[1]


@dataclass(frozen=True)
class ClusterSpec:
    """The parties of a cluster in rank order (rank = position in the list)."""

    parties: tuple[PartySpec, ...]

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
    def from_yaml(cls, path: str | Path) -> ClusterSpec:
        """Load and validate a cluster file; relative TLS paths resolve against its folder."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read cluster file {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        return cls.from_dict(data, base_dir=path.parent, source=str(path))

    @classmethod
    def from_dict(
        cls, data: Any, *, base_dir: str | Path | None = None, source: str = "cluster"
    ) -> ClusterSpec:
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a mapping with 'parties', got {data!r}")
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)}; expected 'parties'")
        entries = data.get("parties")
        if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
            raise ConfigError(f"{source}.parties: expected a non-empty list, got {entries!r}")
        parties = tuple(
            _party(entry, f"{source}.parties[{i}]", base) for i, entry in enumerate(entries)
        )
        _check_unique(parties, source)
        if len({p.tls is None for p in parties}) > 1:
            raise ConfigError(f"{source}: either every party has tls files or none does")
        return cls(parties)

    @classmethod
    def local(
        cls, names: Sequence[str] | int, *, host: str = "127.0.0.1", device: str | None = None
    ) -> ClusterSpec:
        """Parties on this host at free ports (names, or a count giving P0, P1, ...)."""
        if isinstance(names, int):
            names = [f"P{i}" for i in range(names)]
        parties = []
        for name in names:
            endpoint = f"{host}:{free_port(host)}"
            parties.append(PartySpec(name, endpoint, endpoint, device))
        return cls.from_dict(
            {"parties": [_as_dict(p) for p in parties]}, source="ClusterSpec.local"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"parties": [_as_dict(p) for p in self.parties]}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _as_dict(p: PartySpec) -> dict[str, Any]:
    d: dict[str, Any] = {"name": p.name, "endpoint": p.endpoint, "listen": p.listen}
    if p.device is not None:
        d["device"] = p.device
    if p.tls is not None:
        d["tls"] = {"ca": str(p.tls.ca), "cert": str(p.tls.cert), "key": str(p.tls.key)}
    return d


def _party(entry: Any, where: str, base: Path) -> PartySpec:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {entry!r}")
    unknown = set(entry) - _PARTY_KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {sorted(unknown)}; expected {sorted(_PARTY_KEYS)}"
        )
    for required in ("name", "endpoint"):
        if required not in entry:
            raise ConfigError(f"{where}: missing required key {required!r}")
    name = entry["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"{where}.name: expected a letter then letters, digits, '_', '.' or '-', "
            f"got {name!r}"
        )
    endpoint = entry["endpoint"]
    _, port = split_endpoint(endpoint, f"{where}.endpoint")
    listen = entry.get("listen", f"[::]:{port}")
    split_endpoint(listen, f"{where}.listen")
    device = entry.get("device")
    if device is not None and (not isinstance(device, str) or not _DEVICE.match(device)):
        raise ConfigError(
            f"{where}.device: expected 'cpu', 'cpu:N', 'cuda:N' (or rocm/tpu), got {device!r}"
        )
    tls = _tls(entry["tls"], f"{where}.tls", base) if entry.get("tls") is not None else None
    return PartySpec(name, endpoint, listen, device, tls)


def _tls(entry: Any, where: str, base: Path) -> TLSFiles:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping with ca, cert and key, got {entry!r}")
    unknown = set(entry) - _TLS_KEYS
    missing = _TLS_KEYS - set(entry)
    if unknown or missing:
        raise ConfigError(
            f"{where}: expected keys ca, cert, key; unknown {sorted(unknown)}, "
            f"missing {sorted(missing)}"
        )
    paths = {}
    for key in ("ca", "cert", "key"):
        value = entry[key]
        if not isinstance(value, str | Path):
            raise ConfigError(f"{where}.{key}: expected a file path, got {value!r}")
        path = (base / value).resolve()
        if not path.is_file():
            raise ConfigError(f"{where}.{key}: file not found: {path}")
        paths[key] = path
    return TLSFiles(**paths)


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
