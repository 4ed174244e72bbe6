"""gRPC server wrapping the engine in the decode role."""
