"""Moving KV blocks between engines: one contract, UCX and LMCache backends, and the
compatibility fingerprint checked at handshake (issue #3)."""
