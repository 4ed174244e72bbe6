"""Moving KV blocks between engines: one contract, UCX and LMCache backends, and the
compatibility fingerprint checked at each pull's handshake."""
