"""Generated protobuf and gRPC code of the beton-serve wire, version 1 (do not edit).

Regenerate with ``scripts/gen_proto.sh``; CI runs ``scripts/check_proto.sh``.
"""
