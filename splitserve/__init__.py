"""splitserve: disaggregated prefill/decode LLM serving.

This package is the product's entry point (``splitserve.cli``, the ``splitserve`` command),
with the flags its commands share (``splitserve.flags``) and the engine's offline command
(``splitserve.generate``), and holds the gRPC stubs generated from ``proto/`` (``splitserve.v1``). The parts it runs
live in their own top-level packages: ``engine``, ``kv_connector``, ``prefill_svc``,
``decode_svc``, ``colocated_svc``, ``gateway``, ``launcher``, ``bench``, ``microbench``.
"""
