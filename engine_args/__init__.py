"""The engine's command-line flags (:mod:`engine_args.flags`, torch-free) and the one place
they become an ``EngineConfig`` (:mod:`engine_args.config`). Every command imports them from
here: the product's CLI (``splitserve``), the instances (``serving``), the launcher, the
benchmarks; the engine imports nothing of it."""
