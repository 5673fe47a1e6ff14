"""A party's datasets and outputs directory: all that `mp.read` and `mp.write` can reach.

Programs name datasets, never paths. Files are checked when the party starts; `.npy` files are
memory-mapped, tables (`.csv`, `.parquet`) read through Arrow; writes go to
`<outputs>/<name>.npy` (a table: `.parquet` or `.csv`) through a temporary file and a rename.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mpplug.config import DATASET_NAME, DatasetSpec, OutputsSpec
from mpplug.core import TableType, TensorType, ValueType
from mpplug.errors import ConfigError, DatasetError, TableError, UnsupportedDTypeError

TABLE_WRITE_FORMATS = ("parquet", "csv")


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
        self._types: dict[str, ValueType] = {}
        self._csv: dict[str, Any] = {}
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

    def types(self) -> dict[str, ValueType]:
        """Every dataset's type, by name."""
        return dict(self._types)

    def info(self, name: str) -> ValueType:
        """The dtype and shape of dataset `name`, or a table's columns and row count (never
        its data)."""
        self._check_name(name, "read")
        found = self._types.get(name)
        if found is None:
            exposed = ", ".join(sorted(self._types)) or "none"
            raise DatasetError(
                f"party {self.party} exposes no dataset {name!r}; it exposes: {exposed}"
            )
        return found

    def load(self, name: str, expected: ValueType) -> Any:
        """The dataset as an array (memory-mapped for .npy) or a table, checked against
        `expected`."""
        ttype = self.info(name)
        spec = self._specs[name]
        if spec.table:
            array = self._table(spec)
            ttype = (
                TableType(ttype.columns, array.num_rows) if isinstance(ttype, TableType) else ttype
            )
        elif spec.format == ".csv":
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

    def write(self, name: str, value: Any, format: str = "npy") -> Path:
        """Write `value` as `<outputs>/<name>.npy` (a table: `.parquet` or `.csv`, by
        `format`): atomically, never through a symlink, and over an existing file only if the
        outputs allow it."""
        self._check_name(name, "write")
        if self.outputs is None:
            raise DatasetError(f"party {self.party} has no outputs directory to write {name!r} to")
        is_table = format in TABLE_WRITE_FORMATS
        if is_table != (type(value).__name__ == "Table") or format not in (
            "npy",
            *TABLE_WRITE_FORMATS,
        ):
            raise DatasetError(
                f"party {self.party}: cannot write {name!r} as {format!r}: an array is written "
                f"as npy, a table as {' or '.join(TABLE_WRITE_FORMATS)}"
            )
        folder = self.outputs.path
        target = folder / f"{name}.{format}"
        if target.is_symlink():
            raise DatasetError(f"party {self.party}: {target} is a symlink; it is never written")
        if target.exists() and not self.outputs.overwrite:
            raise DatasetError(
                f"party {self.party}: {target} exists and its outputs do not allow overwrite"
            )
        if is_table:
            self._replace(name, target, lambda out: _write_table(value, format, out))
            return target
        array = np.asarray(value)
        if array.dtype.kind == "V" or array.dtype.name == "bfloat16":
            raise DatasetError(
                f"party {self.party}: cannot write {name!r}: a .npy file cannot record "
                f"{array.dtype.name}; cast it first (to float32, for bfloat16)"
            )
        self._replace(name, target, lambda out: np.save(out, array, allow_pickle=False))
        return target

    def _replace(self, name: str, target: Path, fill: Callable[[BinaryIO], None]) -> None:
        """Fill a temporary file in the outputs folder, then move it to `target`."""
        assert self.outputs is not None
        folder = self.outputs.path
        handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(handle, "wb") as out:
                fill(out)
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

    def _check_name(self, name: str, verb: str) -> None:
        if not isinstance(name, str) or not DATASET_NAME.fullmatch(name):
            raise DatasetError(
                f"party {self.party}: cannot {verb} {name!r}: a dataset name is a letter then "
                f"up to 63 letters, digits, '_' or '-' (programs name datasets, never paths)"
            )

    def _check(self, spec: DatasetSpec) -> ValueType:
        where = f"party {self.party}, dataset {spec.name!r} ({spec.path})"
        if not spec.path.is_file():
            problem = "is not a file" if spec.path.exists() else "does not exist"
            raise ConfigError(f"{where}: the file {problem}")
        if spec.table:
            try:
                return _table_type(spec, self._csv, where)
            except TableError as exc:
                raise ConfigError(str(exc)) from None
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{where}: cannot be read as a table: {exc}") from None
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

    def _table(self, spec: DatasetSpec) -> Any:
        if spec.format == ".csv":
            return self._csv[spec.name]
        import pyarrow.parquet as pq

        from mpplug.tables import arrow

        where = f"party {self.party}, dataset {spec.name!r}"
        table = pq.read_table(spec.path)
        return arrow.conform(table, arrow.table_type(table, where, rows=False), where)


def _table_type(spec: DatasetSpec, held: dict[str, Any], where: str) -> TableType:
    """A table dataset's columns and row count; a CSV is read whole and held."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from mpplug.tables import arrow

    if spec.format == ".csv":
        declared = {name: arrow.arrow_type(kind) for name, kind in spec.columns}
        table = pcsv.read_csv(spec.path, convert_options=pcsv.ConvertOptions(column_types=declared))
        missing = sorted(set(declared) - set(table.column_names))
        if missing:
            raise TableError(f"{where}: declares columns {missing} the file does not have")
        ttype = arrow.table_type(table, where)
        held[spec.name] = arrow.conform(table, ttype, where)
        return ttype
    metadata = pq.read_metadata(spec.path)
    schema = pq.read_schema(spec.path)
    columns = [(f.name, arrow.column_kind(f, where)) for f in schema]
    return TableType(columns, metadata.num_rows)


def _write_table(table: Any, format: str, out: BinaryIO) -> None:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    if format == "csv":
        pcsv.write_csv(table, out)
    else:
        pq.write_table(table, out)


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
