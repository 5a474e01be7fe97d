"""Generated gRPC/protobuf code for graft_fed.v1 (scripts/gen_protos.sh). Do not edit.

Only the serialisation module, the broker servicer and the node client import it."""
