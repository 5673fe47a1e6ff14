"""A party's datasets and outputs directory: all that `mp.read` and `mp.write` can reach.

Programs name datasets, never paths. Files are checked when the party starts; `.npy` files are
memory-mapped; writes go to `<outputs>/<name>.npy` through a temporary file and a rename.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpplug.config import DATASET_NAME, DatasetSpec, OutputsSpec
from mpplug.core import TensorType
from mpplug.errors import ConfigError, DatasetError, UnsupportedDTypeError


class Datasets:
    """The datasets party `party` exposes and where it lets programs write.

    Construction checks every file (it exists, its header or contents parse, its dtype is
    supported): a ConfigError names the first bad one.
    """

    def __init__(
        self, party: str, data: Sequence[DatasetSpec] = (), outputs: OutputsSpec | None = None
    ) -> None:
        self.party = party
        self._specs = {spec.name: spec for spec in data}
        self._types: dict[str, TensorType] = {}
        self._csv: dict[str, np.ndarray[Any, Any]] = {}
        for spec in data:
            self._types[spec.name] = self._check(spec)
        self.outputs = outputs
        if outputs is not None:
            try:
                outputs.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"party {party}: outputs directory {outputs.path} cannot be created: "
                    f"{exc.strerror or exc}"
                ) from None

    def types(self) -> dict[str, TensorType]:
        """Every dataset's type, by name."""
        return dict(self._types)

    def info(self, name: str) -> TensorType:
        """The dtype and shape of dataset `name` (never its data)."""
        self._check_name(name, "read")
        found = self._types.get(name)
        if found is None:
            exposed = ", ".join(sorted(self._types)) or "none"
            raise DatasetError(
                f"party {self.party} exposes no dataset {name!r}; it exposes: {exposed}"
            )
        return found

    def load(self, name: str, expected: TensorType) -> np.ndarray[Any, Any]:
        """The dataset as an array (memory-mapped for .npy), checked against `expected`."""
        ttype = self.info(name)
        spec = self._specs[name]
        if spec.format == ".csv":
            array = self._csv[name]
        else:
            array = _open(spec)
            ttype = TensorType(array.dtype, array.shape)
        if ttype != expected:
            raise DatasetError(
                f"party {self.party}: dataset {name!r} is {ttype} now, but the program was "
                f"traced for {expected}; trace it again"
            )
        return array

    def write(self, name: str, value: Any) -> Path:
        """Write `value` as `<outputs>/<name>.npy`: atomically, never through a symlink, and
        over an existing file only if the outputs allow it."""
        self._check_name(name, "write")
        if self.outputs is None:
            raise DatasetError(f"party {self.party} has no outputs directory to write {name!r} to")
        folder = self.outputs.path
        target = folder / f"{name}.npy"
        if target.is_symlink():
            raise DatasetError(f"party {self.party}: {target} is a symlink; it is never written")
        if target.exists() and not self.outputs.overwrite:
            raise DatasetError(
                f"party {self.party}: {target} exists and its outputs do not allow overwrite"
            )
        array = np.asarray(value)
        if array.dtype.kind == "V" or array.dtype.name == "bfloat16":
            raise DatasetError(
                f"party {self.party}: cannot write {name!r}: a .npy file cannot record "
                f"{array.dtype.name}; cast it first (to float32, for bfloat16)"
            )
        handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(handle, "wb") as out:
                np.save(out, array, allow_pickle=False)
                out.flush()
                os.fsync(out.fileno())
            if self.outputs.overwrite:
                os.replace(temporary, target)
            else:
                try:
                    os.link(temporary, target)  # fails if the name was taken meanwhile
                except FileExistsError:
                    raise DatasetError(
                        f"party {self.party}: {target} exists and its outputs do not allow "
                        f"overwrite"
                    ) from None
                os.unlink(temporary)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _sync_folder(folder)
        return target

    def _check_name(self, name: str, verb: str) -> None:
        if not isinstance(name, str) or not DATASET_NAME.fullmatch(name):
            raise DatasetError(
                f"party {self.party}: cannot {verb} {name!r}: a dataset name is a letter then "
                f"up to 63 letters, digits, '_' or '-' (programs name datasets, never paths)"
            )

    def _check(self, spec: DatasetSpec) -> TensorType:
        where = f"party {self.party}, dataset {spec.name!r} ({spec.path})"
        if not spec.path.is_file():
            problem = "is not a file" if spec.path.exists() else "does not exist"
            raise ConfigError(f"{where}: the file {problem}")
        try:
            if spec.format == ".csv":
                array = _read_csv(spec)
                self._csv[spec.name] = array
            else:
                array = _open(spec)
            return TensorType(array.dtype, array.shape)
        except UnsupportedDTypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise ConfigError(f"{where}: cannot be read: {exc}") from None


def _open(spec: DatasetSpec) -> np.ndarray[Any, Any]:
    """A .npy memory-mapped, or the array `key` of a .npz (read whole); never unpickled."""
    if spec.format == ".npy":
        return np.load(spec.path, mmap_mode="r", allow_pickle=False)
    with np.load(spec.path, allow_pickle=False) as archive:
        if spec.key not in archive.files:
            raise KeyError(f"no array {spec.key!r} in it; it has {sorted(archive.files)}")
        return archive[spec.key]


def _read_csv(spec: DatasetSpec) -> np.ndarray[Any, Any]:
    """Numbers separated by commas, one row a line, parsed as the declared dtype."""
    array = np.loadtxt(spec.path, delimiter=",", dtype=np.dtype(spec.dtype), ndmin=1)
    if array.size == 0:
        raise ValueError("it holds no numbers")
    return array


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (where the platform allows opening a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
