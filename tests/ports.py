"""Listening ports for the tests: each pytest-xdist worker hands them out from its own block
below the kernel's ephemeral range, so that neither another worker nor an outgoing connection
can take a port a test's party gives up and binds again (a restarted party keeps its port).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

import mpplug.config

SYSTEM_FREE_PORTS = mpplug.config.free_ports
"""mpplug's own `free_ports` (the kernel's choice), which conftest replaces for the tests."""

FIRST_PORT = 10000
"""The lowest port handed out (above the well-known and registered ports commonly used)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _block() -> range:
    """This worker's ports: an equal share of FIRST_PORT up to the ephemeral range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = max((_ephemeral_low() - FIRST_PORT) // workers, 16)
    start = FIRST_PORT + index * size
    return range(start, start + size)


class WorkerPorts:
    """Hands out this worker's ports in turn (a port comes round again only after all the
    others), skipping any that something holds."""

    def __init__(self) -> None:
        self.block = _block()
        self._next = 0
        self._lock = threading.Lock()

    def take(self, count: int, host: str = "127.0.0.1") -> list[int]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with self._lock, contextlib.ExitStack() as stack:
            ports: list[int] = []
            for _ in range(len(self.block)):
                if len(ports) == count:
                    break
                port = self.block[self._next]
                self._next = (self._next + 1) % len(self.block)
                sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                ports.append(port)
            if len(ports) < count:
                raise OSError(f"no {count} free ports in {self.block} on {host}")
            return ports
