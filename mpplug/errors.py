"""Every error mpplug raises on purpose.

All derive from `MPPlugError`, and each also derives from the builtin type a caller would expect.
"""

from __future__ import annotations


class MPPlugError(Exception):
    """Base of every error mpplug raises on purpose."""


class UnsupportedDTypeError(MPPlugError, TypeError):
    """A dtype outside the supported set (object, str, structured, ...)."""


class InvalidPFunctionError(MPPlugError, ValueError):
    """A PFunction that is malformed or cannot run here."""


class ArgumentMismatchError(MPPlugError, ValueError):
    """Arguments that do not match a PFunction's `ins_info`."""


class UnknownKernelError(MPPlugError, LookupError):
    """No kernel serves the requested `fn_type`."""


class DuplicateKernelError(MPPlugError, ValueError):
    """Two sources register a kernel for the same `fn_type`."""


class TraceError(MPPlugError, TypeError):
    """A type or placement error found while tracing a program."""


class InvalidProgramError(MPPlugError, ValueError):
    """Program bytes that do not decode into a well-formed graph."""


class WireError(MPPlugError, ValueError):
    """A value received over a wire that fails validation."""


class WireVersionError(MPPlugError, RuntimeError):
    """A driver and a party that speak different versions of the wire protocol."""


class ConfigError(MPPlugError, ValueError):
    """A cluster configuration that fails validation."""


class DatasetError(MPPlugError, ValueError):
    """A dataset read or write a party refuses: an unknown or malformed name, no outputs
    directory, an existing file or a symlink in the way, or a dataset that changed."""


class TableError(MPPlugError, ValueError):
    """A table a party refuses: columns or rows other than declared, a column kind mpplug
    does not hold, or bytes that are not a valid Arrow IPC stream."""


class SQLError(TableError):
    """A query DuckDB refuses at a party: a syntax or binder error, or a reach for files,
    extensions, settings or the network, which every party's connection forbids."""


class PSIError(TableError):
    """A private set intersection a party refuses: a missing or unsupported key column,
    duplicate keys, or a peer's message of the wrong size or with a low-order point."""


class FixedPointRangeError(MPPlugError, ValueError):
    """A value a party seals that fixed point cannot hold: not finite, or too large."""


class ExecutionAborted(MPPlugError, RuntimeError):
    """An execution was cancelled because another party failed."""


class CommTimeoutError(MPPlugError, TimeoutError):
    """A receive waited longer than the cluster's timeout."""

    def __init__(self, party: int, peer: int, key: str, timeout: float) -> None:
        super().__init__(
            f"party {party} waited {timeout:g}s for a value from party {peer} (key {key})"
        )
        self.party = party
        self.peer = peer
        self.key = key
        self.timeout = timeout

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.party, self.peer, self.key, self.timeout))


class PartyError(MPPlugError, RuntimeError):
    """An error raised on one party while it ran an op."""

    def __init__(self, party: int, op: str, error_type: str, message: str) -> None:
        super().__init__(f"party {party} failed in {op}: {error_type}: {message}")
        self.party = party
        self.op = op
        self.error_type = error_type
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.party, self.op, self.error_type, self.message))


class PartyUnavailableError(MPPlugError, ConnectionError):
    """A party could not be reached, or died during an execution."""

    def __init__(self, party: str, detail: str) -> None:
        super().__init__(f"party {party} is unavailable: {detail}")
        self.party = party
        self.detail = detail

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.party, self.detail))
