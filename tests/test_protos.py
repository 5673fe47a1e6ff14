"""The committed protobuf and gRPC modules are exactly what scripts/gen_protos.py generates.

A .proto edited without regenerating fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_are_up_to_date_with_the_proto_files(tmp_path):
    gen = _gen_protos()
    fresh = {path.name: path.read_bytes() for path in gen.generate(tmp_path)}
    committed = {path.name: path.read_bytes() for path in gen.PROTO_DIR.glob("*_pb2*.py*")}
    assert {f"{p.stem}_pb2.py" for p in gen.PROTO_DIR.glob("*.proto")} <= set(fresh)
    assert sorted(committed) == sorted(fresh), "generated files differ from the committed set"
    stale = [name for name, data in fresh.items() if committed[name] != data]
    assert not stale, f"{stale} are out of date: run `python scripts/gen_protos.py`"
