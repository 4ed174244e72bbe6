"""What the gateway and the instances share, torch-free (the gateway imports it): the
internal plane's gRPC (cluster secret, call token, TLS), KV handles signed by the prefill
instance that issued them, the registry record instances heartbeat and gateways scan,
store URLs as they may be shown (no password), sampling parameters to and from protobuf,
the control calls to a prefill instance's KV leases, and background tasks that must
finish."""
