"""Generate the Python gRPC stubs of protos/hetspec/v1/hetspec.proto next to it, or check they are current.

    python -m protos.generate          # write hetspec_pb2.py, hetspec_pb2.pyi, hetspec_pb2_grpc.py
    python -m protos.generate --check  # exit 1 if the committed stubs differ from freshly generated ones

The stubs are committed (not generated at start-up) because Serve's gRPC proxy imports the servicer
function before any runtime_env applies: every Ray process must find them on its plain import path.
Generated from the repository root so their imports read ``from protos.hetspec.v1 import ...`` and never
collide with the ``hetspec`` library package.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("protos/hetspec/v1/hetspec.proto")
OUTPUTS = ("hetspec_pb2.py", "hetspec_pb2.pyi", "hetspec_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    include = Path(protoc.__file__).parent / "_proto"
    status = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
                          f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(ROOT / PROTO)])
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status} on {PROTO}")


def stale_stubs() -> list[str]:
    """Names of the committed stubs that differ from freshly generated ones (or are missing)."""
    with tempfile.TemporaryDirectory() as scratch:
        generate(Path(scratch))
        fresh_dir, committed_dir = Path(scratch) / PROTO.parent, ROOT / PROTO.parent
        return [name for name in OUTPUTS if not (committed_dir / name).exists()
                or not filecmp.cmp(fresh_dir / name, committed_dir / name, shallow=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the committed stubs are current")
    if parser.parse_args().check:
        stale = stale_stubs()
        if stale:
            print(f"stale gRPC stubs: {', '.join(stale)}; run `python -m protos.generate`", file=sys.stderr)
            return 1
        print("gRPC stubs are current")
        return 0
    generate(ROOT)
    print(f"generated {', '.join(OUTPUTS)} in {PROTO.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
