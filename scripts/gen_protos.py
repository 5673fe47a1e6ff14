"""Regenerate the committed protobuf and gRPC modules under mpplug/protos/.

Run `python scripts/gen_protos.py` after editing a .proto file; a test fails when they drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "mpplug" / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto under mpplug/protos into `out_dir`; return the files written."""
    protos = sorted(p.relative_to(ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    return sorted((out_dir / "mpplug" / "protos").glob("*_pb2*.py*"))


def main() -> None:
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copy(path, PROTO_DIR / path.name)
            print(f"wrote mpplug/protos/{path.name}")


if __name__ == "__main__":
    sys.exit(main())
