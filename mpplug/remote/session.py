"""Sessions on a party: each driver's private store of named values, kept on an idle lease.

Two drivers on one cluster never see each other's values; closing a session drops its store.
Every call naming a session renews its lease; `Sessions.expire` closes those no call has named
for `idle_timeout` seconds, so a driver that died without closing does not hold values forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from mpplug.remote.rpc import BadRequest, Exhausted, NotFound, check_id

MAX_SESSIONS = 1024
DEFAULT_IDLE_TIMEOUT = 3600.0
"""Seconds a session may go without a call before the party closes it."""


class Session:
    """One driver's values on this party, by name."""

    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.last_used = time.monotonic()
        self._values: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Any:
        with self._lock:
            if name not in self._values:
                raise NotFound(
                    "value", f"session {self.id} holds no value named {name!r} (released?)"
                )
            return self._values[name]

    def store(self, values: Mapping[str, Any]) -> None:
        with self._lock:
            self._values.update(values)

    def release(self, names: Iterable[str]) -> int:
        with self._lock:
            return sum(self._values.pop(name, None) is not None for name in names)

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)


class Sessions:
    """The open sessions of one party."""

    def __init__(
        self, max_sessions: int = MAX_SESSIONS, idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    ) -> None:
        self.idle_timeout = idle_timeout
        self._sessions: dict[str, Session] = {}
        self._max = max_sessions
        self._lock = threading.Lock()

    def open(self, session_id: str) -> Session:
        check_id(session_id, "session")
        with self._lock:
            if session_id in self._sessions:
                raise BadRequest(f"session {session_id} is already open")
            if len(self._sessions) >= self._max:
                raise Exhausted(
                    f"this party has {self._max} sessions open, its limit; close some first "
                    f"(idle ones close after {self.idle_timeout:g}s)"
                )
            session = self._sessions[session_id] = Session(session_id)
            return session

    def get(self, session_id: str) -> Session:
        """The open session `session_id`, its lease renewed."""
        with self._lock:
            found = self._sessions.get(session_id)
            if found is not None:
                found.last_used = time.monotonic()
        if found is None:
            raise NotFound("session", f"no open session {session_id!r} on this party")
        return found

    def close(self, session_id: str) -> Session:
        with self._lock:
            found = self._sessions.pop(session_id, None)
        if found is None:
            raise NotFound("session", f"no open session {session_id!r} on this party")
        return found

    def expire(self) -> list[Session]:
        """Close every session no call has named for `idle_timeout` seconds; returns them."""
        cutoff = time.monotonic() - self.idle_timeout
        with self._lock:
            idle = [s for s in self._sessions.values() if s.last_used < cutoff]
            for session in idle:
                del self._sessions[session.id]
        return idle

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
