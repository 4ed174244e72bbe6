"""splitserve: disaggregated prefill/decode LLM serving.

This package is the product's entry point (``splitserve.cli``, the ``splitserve`` command),
with the engine's offline commands (``splitserve.generate``, ``splitserve.perplexity``), and
holds the gRPC stubs generated from ``proto/`` (``splitserve.v1``). The parts it runs live in
their own top-level packages: ``engine``, ``engine_args`` (the engine's flags, which every
command imports), ``kv_connector``, ``prefill_svc``, ``decode_svc``, ``colocated_svc``,
``gateway``, ``launcher``, ``bench``, ``microbench``.
"""
