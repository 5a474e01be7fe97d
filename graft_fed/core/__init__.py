"""The algorithm as pure functions on tensors and plain data (no I/O, no model, no gRPC)."""
