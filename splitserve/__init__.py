"""splitserve: disaggregated prefill/decode LLM serving.

This package is the product's entry point (``splitserve.cli``, the ``splitserve`` command)
and holds the gRPC stubs generated from ``proto/`` (``splitserve.v1``). The parts it runs
live in their own top-level packages: ``engine``, ``kv_connector``, ``prefill_svc``,
``decode_svc``, ``gateway``, ``launcher``, ``bench``.
"""
