"""Client benchmarks: ``splitserve bench`` (serve, sweep, plot) load-tests an OpenAI-compatible
server over HTTP, and the study, overload, routing, control-plane and token-profile runs start
a stack and measure it from outside. None of them imports the engine, a connector or an
instance; the in-process benchmarks that do are in ``microbench/``."""
