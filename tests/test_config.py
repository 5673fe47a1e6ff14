"""Cluster files: every validation error names its field, defaults fill in, and the
Simulator takes the same spec."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpplug as mp
from mpplug.config import ClusterSpec, PartySpec, ServerLimits, TLSFiles, free_port, split_endpoint
from mpplug.errors import ConfigError, MPPlugError

from .ports import SYSTEM_FREE_PORTS, WorkerPorts


def two_parties(**extra: Any) -> dict[str, Any]:
    return {
        "parties": [
            {"name": "alice", "endpoint": "10.0.0.1:7000", **extra},
            {"name": "bob", "endpoint": "10.0.0.2:7000", **extra},
        ]
    }


def pem_files(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("-----BEGIN PLACEHOLDER-----\n")


def load_error(data: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        ClusterSpec.from_dict(data, **kwargs)
    return str(info.value)


# -- what a valid file gives -------------------------------------------------------------------
def test_yaml_file_loads_parties_in_rank_order(tmp_path: Path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "parties:\n"
        "  - {name: alice, endpoint: 'alice.example:7000', device: 'cuda:0'}\n"
        "  - {name: bob, endpoint: '10.0.0.2:7001', listen: '10.0.0.2:7001', device: cpu}\n"
        "  - {name: carol, endpoint: '[fd00::3]:7002', device: 'cpu:1'}\n"
    )
    spec = ClusterSpec.from_yaml(path)
    assert spec.names == ["alice", "bob", "carol"]
    assert spec.world_size == 3
    assert [spec.rank_of(n) for n in spec.names] == [0, 1, 2]
    assert spec.party("bob") is spec.party(1) is spec.parties[1]
    assert spec.party(0) == PartySpec("alice", "alice.example:7000", "[::]:7000", "cuda:0")
    assert spec.party("bob").listen == "10.0.0.2:7001"
    assert (spec.party("carol").host, spec.party("carol").port) == ("fd00::3", 7002)
    assert [p.device for p in spec.parties] == ["cuda:0", "cpu", "cpu:1"]
    assert not spec.tls


def test_listen_defaults_to_the_endpoint_port_on_all_interfaces():
    spec = ClusterSpec.from_dict(two_parties())
    assert [p.listen for p in spec.parties] == ["[::]:7000", "[::]:7000"]
    assert [p.device for p in spec.parties] == [None, None]


def test_a_bulk_port_is_dialled_at_its_host_and_bound_on_the_listen_host():
    data = two_parties()
    data["parties"][0]["bulk"] = "alice.example:7001"
    data["parties"][1] |= {"bulk": "[fd00::2]:7001", "listen": "10.0.0.2:7000"}
    spec = ClusterSpec.from_dict(data)
    assert [p.bulk for p in spec.parties] == ["alice.example:7001", "[fd00::2]:7001"]
    assert [p.bulk_listen for p in spec.parties] == [("::", 7001), ("10.0.0.2", 7001)]
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert ClusterSpec.from_dict(two_parties()).parties[0].bulk_listen is None


@pytest.mark.parametrize(
    ("bulk", "expected"),
    [
        (
            "10.0.0.1:7000",
            "cluster.parties[0].bulk: expected a port of its own, got '10.0.0.1:7000'",
        ),
        ("10.0.0.1", "cluster.parties[0].bulk: expected 'host:port', got '10.0.0.1' (no port)"),
        (7001, "cluster.parties[0].bulk: expected 'host:port' as a string, got 7001"),
    ],
)
def test_bad_bulk_ports_are_named(bulk: Any, expected: str):
    data = two_parties()
    data["parties"][0]["bulk"] = bulk
    assert load_error(data).startswith(expected)


def test_a_bulk_address_may_be_no_other_partys_address():
    data = two_parties()
    data["parties"][0]["endpoint"] = "10.0.0.1:7009"
    data["parties"][1]["bulk"] = "10.0.0.1:7009"
    assert load_error(data) == (
        "cluster.parties[1].bulk: duplicate '10.0.0.1:7009' (also parties[0].endpoint)"
    )
    data["parties"][0]["bulk"] = data["parties"][1]["bulk"] = "10.0.0.3:7001"
    assert load_error(data) == (
        "cluster.parties[1].bulk: duplicate '10.0.0.3:7001' (also parties[0].bulk)"
    )


def test_local_clusters_give_every_party_ports_of_its_own():
    spec = ClusterSpec.local(3)
    ports = [p.port for p in spec.parties] + [p.bulk_listen[1] for p in spec.parties]  # type: ignore[index]
    assert len(set(ports)) == 6


def test_to_dict_round_trips():
    spec = ClusterSpec.from_dict(two_parties(device="cpu"))
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


def test_unknown_party_or_rank_is_named():
    spec = ClusterSpec.from_dict(two_parties())
    with pytest.raises(ConfigError, match=r"no party named 'carol'; parties: \['alice', 'bob'\]"):
        spec.party("carol")
    with pytest.raises(ConfigError, match=r"rank 2 outside 0\.\.1"):
        spec.party(2)


def test_config_errors_are_mpplug_errors_and_value_errors():
    with pytest.raises(MPPlugError):
        ClusterSpec.from_dict({})
    with pytest.raises(ValueError):
        ClusterSpec.from_dict({})


# -- the shape of the document ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (None, "cluster: expected a mapping with a 'parties' list, got an empty document"),
        ([1, 2], "cluster: expected a mapping with a 'parties' list, got list [1, 2]"),
        ("parties", "cluster: expected a mapping with a 'parties' list, got str 'parties'"),
        ({}, "cluster: missing required key 'parties'"),
        ({"parties": []}, "cluster.parties: expected a non-empty list of parties, got []"),
        ({"parties": None}, "cluster.parties: expected a non-empty list of parties, got None"),
        ({"parties": "alice"}, "cluster.parties: expected a non-empty list of parties"),
        ({"parties": ["alice"]}, "cluster.parties[0]: expected a mapping, got 'alice'"),
    ],
)
def test_malformed_documents_are_rejected(data: Any, expected: str):
    assert load_error(data).startswith(expected)


def test_unknown_top_level_keys_are_named():
    message = load_error({**two_parties(), "timeout": 3, 7: "x"})
    assert message == "cluster: unknown key(s) ['7', 'timeout']; expected ['limits', 'parties']"


def test_server_limits_load_from_the_limits_block_and_round_trip():
    spec = ClusterSpec.from_dict({**two_parties(), "limits": {"sessions": 4, "stream_idle_s": 2}})
    assert (spec.limits.sessions, spec.limits.stream_idle_s) == (4, 2)
    assert spec.limits.executes == ServerLimits().executes  # the rest keep their defaults
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert "limits" not in ClusterSpec.from_dict(two_parties()).to_dict()


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        (
            {"session": 4},
            "cluster.limits: unknown limit(s) ['session']; expected ['bulk_connections', ",
        ),
        ({"sessions": 1.5}, "cluster.limits.sessions: expected int, got 1.5"),
        ({"stream_idle_s": "2"}, "cluster.limits.stream_idle_s: expected float, got '2'"),
        ({"sessions": True}, "cluster.limits.sessions: expected int, got True"),
        ({"sessions": 0}, "ServerLimits.sessions: expected a positive int, got 0"),
        ([4], "cluster.limits: expected a mapping of limit names to numbers, got [4]"),
    ],
)
def test_bad_server_limits_are_named(limits: Any, expected: str):
    assert load_error({**two_parties(), "limits": limits}).startswith(expected)


def test_command_line_limits_override_the_files():
    limits = ServerLimits(sessions=4).overridden(["executes=2", "stream_idle_s=0.5"], "--limit")
    assert (limits.sessions, limits.executes, limits.stream_idle_s) == (4, 2, 0.5)
    for bad, message in [
        ("executes", "--limit: expected NAME=VALUE with NAME one of ['bulk_connections', "),
        ("nope=1", "--limit: expected NAME=VALUE with NAME one of"),
        ("executes=2.5", "--limit: executes expects int, got '2.5'"),
    ]:
        with pytest.raises(ConfigError) as info:
            limits.overridden([bad], "--limit")
        assert str(info.value).startswith(message)


def test_unknown_party_keys_are_named():
    data = two_parties()
    data["parties"][1]["port"] = 7000
    message = load_error(data)
    assert message.startswith("cluster.parties[1]: unknown key(s) ['port']; expected [")
    assert "'endpoint'" in message and "'listen'" in message


def test_unknown_tls_keys_are_named(tmp_path: Path):
    pem_files(tmp_path, "ca.pem", "a.pem", "a.key")
    data = two_parties(tls={"ca": "ca.pem", "cert": "a.pem", "key": "a.key", "password": "x"})
    message = load_error(data, base_dir=tmp_path)
    assert message == (
        "cluster.parties[0].tls: unknown key(s) ['password']; expected ca, cert and key"
    )


@pytest.mark.parametrize("missing", ["name", "endpoint"])
def test_missing_required_party_keys_are_named(missing: str):
    data = two_parties()
    del data["parties"][0][missing]
    assert load_error(data) == f"cluster.parties[0]: missing required key {missing!r}"


def test_source_prefixes_the_messages():
    assert load_error({}, source="prod.yaml").startswith("prod.yaml: ")


# -- names and endpoints ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "1st", "al ice", "alice\n", "a/b", 7, None, "x" * 65])
def test_bad_party_names_are_rejected(name: Any):
    data = two_parties()
    data["parties"][0]["name"] = name
    assert load_error(data).startswith("cluster.parties[0].name: expected a letter then")


def test_duplicate_names_are_rejected():
    data = two_parties()
    data["parties"][1]["name"] = "alice"
    assert load_error(data) == ("cluster.parties[1].name: duplicate 'alice' (also parties[0])")


def test_duplicate_endpoints_are_rejected():
    data = two_parties()
    data["parties"].append({"name": "carol", "endpoint": "10.0.0.1:7000"})
    assert load_error(data) == (
        "cluster.parties[2].endpoint: duplicate '10.0.0.1:7000' (also parties[0])"
    )


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("alice.example", "expected 'host:port', got 'alice.example' (no port)"),
        ("alice.example:", "expected a port in 1..65535, got 'alice.example:'"),
        ("alice.example:http", "expected a port in 1..65535, got 'alice.example:http'"),
        ("alice.example:0", "expected a port in 1..65535, got 'alice.example:0'"),
        ("alice.example:65536", "expected a port in 1..65535, got 'alice.example:65536'"),
        ("alice.example:-1", "expected a port in 1..65535"),
        (":7000", "expected a host name or IPv4 address before the port, got ':7000'"),
        ("http://alice:7000", "expected a host name or IPv4 address before the port"),
        ("fd00::1:7000", "an IPv6 address needs brackets, as in '[::1]:50051'"),
        ("[fd00::1]", "expected '[IPv6 address]:port', got '[fd00::1]'"),
        ("[not-v6]:7000", "expected an IPv6 address inside the brackets, got '[not-v6]:7000'"),
        ("[fd00::1]:99999", "expected a port in 1..65535"),
        (7000, "expected 'host:port' as a string, got 7000"),
    ],
)
def test_malformed_endpoints_are_rejected(endpoint: Any, problem: str):
    data = two_parties()
    data["parties"][1]["endpoint"] = endpoint
    assert load_error(data).startswith(f"cluster.parties[1].endpoint: {problem}")


def test_malformed_listen_addresses_are_rejected():
    data = two_parties()
    data["parties"][0]["listen"] = "0.0.0.0"
    assert (
        load_error(data)
        == "cluster.parties[0].listen: expected 'host:port', got '0.0.0.0' (no port)"
    )


@pytest.mark.parametrize(
    ("endpoint", "host", "port"),
    [
        ("localhost:1", "localhost", 1),
        ("10.1.2.3:65535", "10.1.2.3", 65535),
        ("[::1]:50051", "::1", 50051),
        ("[::]:80", "::", 80),
        ("party-0.mpc.internal:443", "party-0.mpc.internal", 443),
    ],
)
def test_well_formed_endpoints_split(endpoint: str, host: str, port: int):
    assert split_endpoint(endpoint, "here") == (host, port)


# -- devices ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cpu:12", "cuda:0", "cuda", "rocm:1", "tpu:0"])
def test_device_strings_accepted(device: str):
    assert ClusterSpec.from_dict(two_parties(device=device)).parties[0].device == device


@pytest.mark.parametrize("device", ["gpu:0", "cuda:", "cuda:x", "CPU", "cpu:0\n", "cuda:-1", 0, ""])
def test_bad_device_strings_are_rejected(device: Any):
    assert load_error(two_parties(device=device)).startswith(
        "cluster.parties[0].device: expected 'cpu', 'cpu:N', 'cuda:N' (or rocm/tpu), got"
    )


# -- TLS files --------------------------------------------------------------------------------
def tls_cluster(folder: Path) -> dict[str, Any]:
    pem_files(folder / "certs", "ca.pem", "alice.pem", "alice.key", "bob.pem", "bob.key")
    return {
        "parties": [
            {
                "name": name,
                "endpoint": f"10.0.0.{i}:7000",
                "tls": {
                    "ca": "certs/ca.pem",
                    "cert": f"certs/{name}.pem",
                    "key": f"certs/{name}.key",
                },
            }
            for i, name in enumerate(["alice", "bob"], start=1)
        ]
    }


def test_relative_tls_paths_resolve_against_the_files_folder(tmp_path: Path, monkeypatch):
    import yaml

    data = tls_cluster(tmp_path / "conf")
    path = tmp_path / "conf" / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # elsewhere than the file
    spec = ClusterSpec.from_yaml(Path("conf") / "cluster.yaml")
    certs = (tmp_path / "conf" / "certs").resolve()
    assert spec.tls
    assert spec.party("bob").tls == TLSFiles(certs / "ca.pem", certs / "bob.pem", certs / "bob.key")


def test_absolute_tls_paths_are_kept(tmp_path: Path):
    data = tls_cluster(tmp_path)
    for party in data["parties"]:
        party["tls"] = {k: str(tmp_path / v) for k, v in party["tls"].items()}
    spec = ClusterSpec.from_dict(data, base_dir="/nonexistent")
    assert spec.party("alice").tls == TLSFiles(
        tmp_path / "certs/ca.pem", tmp_path / "certs/alice.pem", tmp_path / "certs/alice.key"
    )


def test_missing_tls_file_is_named_with_its_path(tmp_path: Path):
    data = tls_cluster(tmp_path)
    (tmp_path / "certs" / "bob.key").unlink()
    message = load_error(data, base_dir=tmp_path)
    assert message == (
        f"cluster.parties[1].tls.key: expected a PEM file, but {tmp_path / 'certs/bob.key'} "
        f"does not exist ('certs/bob.key' relative to {tmp_path})"
    )


def test_only_the_named_parties_tls_files_must_exist_on_this_host(tmp_path: Path):
    data = tls_cluster(tmp_path)
    for name in ("bob.pem", "bob.key"):
        (tmp_path / "certs" / name).unlink()  # bob's key lives on bob's host, not here
    spec = ClusterSpec.from_dict(data, base_dir=tmp_path, files_of=["alice"])
    assert spec.party("bob").tls is not None
    assert spec.party("bob").tls.key == (tmp_path / "certs" / "bob.key").resolve()
    assert ClusterSpec.from_dict(data, base_dir=tmp_path, files_of=[]).tls
    with pytest.raises(ConfigError, match=r"parties\[1\]\.tls\.cert: expected a PEM file"):
        ClusterSpec.from_dict(data, base_dir=tmp_path, files_of=["bob"])
    with pytest.raises(ConfigError, match=r"parties\[1\]\.tls\.cert"):
        ClusterSpec.from_dict(data, base_dir=tmp_path)


def test_tls_path_that_is_a_folder_is_rejected(tmp_path: Path):
    data = tls_cluster(tmp_path)
    data["parties"][0]["tls"]["ca"] = str(tmp_path / "certs")
    message = load_error(data, base_dir=tmp_path)
    assert message == (
        f"cluster.parties[0].tls.ca: expected a PEM file, but {tmp_path / 'certs'} is not a file"
    )


def test_missing_tls_keys_are_named(tmp_path: Path):
    data = tls_cluster(tmp_path)
    del data["parties"][0]["tls"]["key"]
    assert load_error(data, base_dir=tmp_path) == (
        "cluster.parties[0].tls: missing key(s) ['key']; expected ca, cert and key"
    )


@pytest.mark.parametrize("tls", ["certs/", ["ca.pem"], 1])
def test_tls_must_be_a_mapping(tmp_path: Path, tls: Any):
    assert load_error(two_parties(tls=tls), base_dir=tmp_path).startswith(
        "cluster.parties[0].tls: expected a mapping with ca, cert and key, got"
    )


def test_tls_paths_must_be_strings(tmp_path: Path):
    data = tls_cluster(tmp_path)
    data["parties"][1]["tls"]["cert"] = 5
    assert load_error(data, base_dir=tmp_path) == (
        "cluster.parties[1].tls.cert: expected a file path, got 5"
    )


def test_mixing_tls_and_plaintext_parties_is_rejected(tmp_path: Path):
    data = tls_cluster(tmp_path)
    del data["parties"][1]["tls"]
    assert load_error(data, base_dir=tmp_path) == (
        "cluster.parties: either every party has a tls block or none does; "
        "with tls: ['alice'], without: ['bob']"
    )


# -- reading the file -------------------------------------------------------------------------
def test_missing_file_is_a_config_error(tmp_path: Path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"cannot read cluster file {path}: No such")):
        ClusterSpec.from_yaml(path)


def test_a_folder_is_not_a_cluster_file(tmp_path: Path):
    with pytest.raises(ConfigError, match=re.escape(f"cannot read cluster file {tmp_path}: ")):
        ClusterSpec.from_yaml(tmp_path)


def test_invalid_yaml_is_a_config_error(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("parties: [\n  - name: alice\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not valid YAML")):
        ClusterSpec.from_yaml(path)


def test_binary_file_is_a_config_error(tmp_path: Path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00parties")
    with pytest.raises(ConfigError, match=re.escape(f"cluster file {path} is not UTF-8 text")):
        ClusterSpec.from_yaml(path)


def test_empty_file_is_a_config_error(tmp_path: Path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: expected a mapping")):
        ClusterSpec.from_yaml(path)


def test_errors_in_a_file_name_the_file(tmp_path: Path):
    path = tmp_path / "cluster.yaml"
    path.write_text("parties:\n  - {name: alice, endpoint: 'alice'}\n")
    with pytest.raises(ConfigError) as info:
        ClusterSpec.from_yaml(path)
    assert str(info.value).startswith(f"{path}.parties[0].endpoint: expected 'host:port'")


# -- local clusters ---------------------------------------------------------------------------
def test_local_gives_named_parties_on_distinct_free_loopback_ports():
    spec = ClusterSpec.local(["alice", "bob", "carol"], device="cpu")
    assert spec.names == ["alice", "bob", "carol"]
    assert all(p.host == "127.0.0.1" and p.listen == p.endpoint for p in spec.parties)
    assert len({p.port for p in spec.parties}) == 3
    assert {p.device for p in spec.parties} == {"cpu"}


def test_local_with_a_count_names_parties_by_rank():
    spec = ClusterSpec.local(2)
    assert spec.names == ["P0", "P1"]
    assert spec.parties[0].device is None


def test_free_ports_are_distinct_and_bindable_and_the_tests_take_their_workers_own():
    import socket

    for ports in (SYSTEM_FREE_PORTS(3), [free_port(), free_port()]):
        assert len(set(ports)) == len(ports)
        for port in ports:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
    taken = free_port()
    assert taken in WorkerPorts().block
    assert free_port() != taken


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_each_test_worker_takes_ports_from_a_block_of_its_own(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    blocks = []
    for index in range(workers):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        blocks.append(set(WorkerPorts().block))
    assert all(len(b) >= 16 for b in blocks)
    assert sum(len(b) for b in blocks) == len(set().union(*blocks))  # no port in two blocks


# -- the Simulator takes a spec ---------------------------------------------------------------
def test_simulator_takes_names_and_devices_from_a_spec():
    spec = ClusterSpec.from_dict(
        {
            "parties": [
                {"name": "alice", "endpoint": "a.example:1", "device": "cpu:0"},
                {"name": "bob", "endpoint": "b.example:1", "device": "cpu"},
            ]
        }
    )

    @mp.function
    def bob_learns(a: mp.MPObject, b: mp.MPObject) -> mp.MPObject:
        return mp.run_jax_at("bob", lambda x, y: x + y, mp.p2p("alice", "bob", a), b)

    with mp.Simulator(spec) as sim:
        assert sim.parties == ["alice", "bob"]
        assert [d.platform for d in sim.devices()] == ["cpu", "cpu"]
        a = sim.put("alice", np.int32(2))
        b = sim.put("bob", np.int32(40))
        assert sim.fetch(sim.evaluate(bob_learns, a, b), party="bob") == 42


def test_simulator_rejects_a_device_the_spec_names_but_this_host_lacks():
    spec = ClusterSpec.from_dict(two_parties(device="cpu:999"))
    with pytest.raises(ConfigError, match="cpu:999"):
        mp.Simulator(spec)
