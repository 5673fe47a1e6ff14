"""Sessions on a party: each driver's private store of named values.

Two drivers on one cluster never see each other's values; closing a session drops its store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from mpplug.remote.rpc import BadRequest, NotFound, check_id

MAX_SESSIONS = 1024


class Session:
    """One driver's values on this party, by name."""

    def __init__(self, session_id: str) -> None:
        self.id = session_id
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

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._sessions: dict[str, Session] = {}
        self._max = max_sessions
        self._lock = threading.Lock()

    def open(self, session_id: str) -> Session:
        check_id(session_id, "session")
        with self._lock:
            if session_id in self._sessions:
                raise BadRequest(f"session {session_id} is already open")
            if len(self._sessions) >= self._max:
                raise BadRequest(f"too many open sessions ({self._max}); close some first")
            session = self._sessions[session_id] = Session(session_id)
            return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            found = self._sessions.get(session_id)
        if found is None:
            raise NotFound("session", f"no open session {session_id!r} on this party")
        return found

    def close(self, session_id: str) -> Session:
        with self._lock:
            found = self._sessions.pop(session_id, None)
        if found is None:
            raise NotFound("session", f"no open session {session_id!r} on this party")
        return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
