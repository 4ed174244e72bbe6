"""Tensor parallelism: one instance's model split across worker processes, one per rank
(layout.py: who holds what; group.py: the collectives; executor.py and worker.py: the
processes and the step inputs they share)."""
