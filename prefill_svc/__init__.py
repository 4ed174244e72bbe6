"""gRPC server wrapping the engine in the prefill role."""
