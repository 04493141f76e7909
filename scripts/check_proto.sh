#!/usr/bin/env bash
# CI check: regenerate proto/beton_wire/v1 into a temp dir and diff it against the committed files.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
bash "$root/scripts/gen_proto.sh" "$tmp"
status=0
for f in "$tmp"/beton_wire/v1/*_pb2*.py "$tmp"/beton_wire/v1/*.pyi; do
  name="$(basename "$f")"
  # Version stamps of the generator (protoc/grpcio-tools release) are not content: ignore them, so
  # that a newer grpcio-tools in CI does not fail the check when the generated code is the same.
  if ! diff -u -I '^# Protobuf Python Version' -I '^    [0-9][0-9]*,$' \
      -I '^GRPC_GENERATED_VERSION' "$root/proto/beton_wire/v1/$name" "$f"; then
    echo "proto/beton_wire/v1/$name is stale: run scripts/gen_proto.sh" >&2
    status=1
  fi
done
exit $status
