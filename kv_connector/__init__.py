"""Moving KV blocks between engines: UCX and LMCache backends (issue #3)."""
