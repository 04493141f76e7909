#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC code of proto/beton_wire/v1 from its .proto files.
#
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: proto/, i.e. in place)
# The generated code imports itself as `beton_wire.v1.*`; the .pyi stubs are normalised with ruff so
# that they pass the project's lint and format checks.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/proto}"
mkdir -p "$out/beton_wire/v1"
cd "$root/proto"
python -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  beton_wire/v1/*.proto
touch "$out/beton_wire/v1/__init__.py"
if [ "$out" != "$root/proto" ]; then
  cp "$root/proto/beton_wire/v1/__init__.py" "$out/beton_wire/v1/__init__.py"
fi
ruff check -q --fix-only --config "$root/pyproject.toml" "$out"/beton_wire/v1/*.pyi >/dev/null || true
ruff format -q --config "$root/pyproject.toml" "$out"/beton_wire/v1/*.pyi
