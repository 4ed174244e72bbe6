"""``splitserve up``: a gateway and its prefill and decode instances as local processes."""
