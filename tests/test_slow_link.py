"""A party behind a slow link: a connection whose handshake takes a few tenths of a second (a
link with long round trips, or a busy party) is waited for, not refused as unavailable.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

import numpy as np
import yaml

import mpplug as mp
from mpplug.config import ClusterSpec, split_endpoint
from mpplug.remote.certs import with_tls, write_dev_certs
from mpplug.remote.driver import Driver

from .clusters import in_process

ONE_WAY_S = 0.15
"""Each byte's delay on the link, each way: a TLS handshake over it takes over half a second."""


class DelayLine:
    """A TCP relay from a free loopback port to `target` that hands on each byte `delay_s`
    after it arrived, both ways: a link with long round trips but no loss."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.target = split_endpoint(target, "target")
        self.delay_s = delay_s
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> DelayLine:
        threading.Thread(target=self._accept, name="delay-line", daemon=True).start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
                far = socket.create_connection(self.target)
            except OSError:
                return  # closed
            with self._lock:
                self.connections += 1
                self._sockets += [near, far]
            for source, sink in ((near, far), (far, near)):
                held: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(source, held), daemon=True).start()
                threading.Thread(target=self._write, args=(sink, held), daemon=True).start()

    def _read(self, source: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            held.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _write(self, sink: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
            except OSError:
                return


@mp.function
def doubled(x: mp.MPObject) -> mp.MPObject:
    return mp.run_jax(lambda a: a * 2, x)


def test_a_driver_reaches_a_party_whose_tls_handshake_takes_half_a_second(tmp_path: Path):
    spec = ClusterSpec.local(1)
    spec = with_tls(spec, write_dev_certs(spec, tmp_path / "certs"))
    with in_process(spec), DelayLine(spec.parties[0].endpoint, ONE_WAY_S) as link:
        data = spec.to_dict()
        data["parties"][0]["endpoint"] = link.endpoint  # the driver dials the slow link
        config = tmp_path / "cluster.yaml"
        config.write_text(yaml.safe_dump(data))
        started = time.monotonic()
        with Driver(config, timeout=30.0) as driver:
            x = driver.put(0, np.arange(4, dtype=np.float32))
            got = driver.fetch(driver.evaluate(doubled, x), party=0)
        took = time.monotonic() - started
    np.testing.assert_array_equal(got, [0.0, 2.0, 4.0, 6.0])
    assert link.connections >= 1
    assert took > 4 * ONE_WAY_S, f"{took:.2f}s: the driver did not go over the slow link"
