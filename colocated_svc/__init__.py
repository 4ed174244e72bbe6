"""gRPC server wrapping the engine in the colocated role: both phases, no KV hand-off."""
