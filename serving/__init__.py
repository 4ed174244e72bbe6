"""What the prefill and decode services share: an engine instance served over gRPC
(engine and connector set-up, health, load report, graceful shutdown) and the
conversions between protobuf messages and engine types. What the gateway shares with
the instances, torch-free, is in ``cluster/``."""
