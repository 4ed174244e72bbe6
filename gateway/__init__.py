"""OpenAI-compatible REST and gRPC front, routing across prefill and decode pools."""
