"""In-process micro-benchmarks of the engine and the KV connector: offline throughput beside
transformers and vLLM, CPU ops and linear paths, KV transfer bandwidth, speculative decoding,
structured outputs, and the GPU session check. Unlike ``bench/`` (the client benchmarks,
which talk to a server over HTTP and never import the engine), these load the engine or a
connector into their own process: ``python -m microbench.throughput`` and so on."""
