"""How a model's heads, MLP and vocabulary are split across tensor-parallel ranks.

Rank ``r`` of ``N`` holds (vLLM's scheme):

- attention: query heads ``[r * H/N, (r + 1) * H/N)`` and the KV heads they read. With
  ``N <= H_kv`` the KV heads split evenly (``H_kv/N`` per rank); with ``N > H_kv`` each rank
  holds one KV head, replicated on ``N/H_kv`` ranks, and N must be a multiple of ``H_kv``;
- MLP: intermediate features ``[r * I/N, (r + 1) * I/N)`` of gate and up (column-parallel)
  and the matching input features of down (row-parallel);
- output projections (o_proj, down_proj) are row-parallel: each rank's partial sums are
  all-reduced, and a bias is added by rank 0 only;
- LM head: vocabulary rows ``[r * V', (r + 1) * V')`` with ``V' = ceil(V/N)`` (the last shard
  padded with zero rows), gathered to every rank after the matmul; the embedding table is
  replicated (a lookup reads a row per token, next to nothing beside the matmuls).

Sizes that do not split this way are refused with an error naming the counts, never rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache_utils import cdiv


@dataclass(frozen=True, slots=True)
class TensorParallelLayout:
    rank: int
    world_size: int
    num_heads: int  # the model's, all ranks together
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        check_tensor_parallel_size(
            self.world_size, self.num_heads, self.num_kv_heads, self.intermediate_size, self.vocab_size
        )
        if not 0 <= self.rank < self.world_size:
            raise RuntimeError(f"bug: rank {self.rank} outside a tensor-parallel group of {self.world_size}")

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def num_local_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def kv_head_start(self) -> int:
        """The first of this rank's KV heads, in the model's numbering."""
        return self.kv_heads.start

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this rank holds."""
        return kv_head_range(self.rank, self.world_size, self.num_kv_heads)

    @property
    def head_start(self) -> int:
        return self.rank * self.num_local_heads

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def local_vocab_size(self) -> int:
        """Rows of this rank's LM-head shard, padding included (every shard has as many)."""
        return cdiv(self.vocab_size, self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab_size


def kv_head_range(rank: int, world_size: int, num_kv_heads: int) -> range:
    """The model's KV heads rank ``rank`` of ``world_size`` holds: an even share, or one head
    replicated on ``world_size / num_kv_heads`` consecutive ranks when the ranks outnumber them."""
    if world_size <= num_kv_heads:
        share = num_kv_heads // world_size
        return range(rank * share, (rank + 1) * share)
    head = rank // (world_size // num_kv_heads)
    return range(head, head + 1)


def check_tensor_parallel_size(
    world_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int
) -> None:
    """Raise ValueError, naming the counts, when a model cannot be split over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {world_size}")
    if world_size == 1:
        return
    if num_heads % world_size:
        raise ValueError(
            f"--tensor-parallel-size {world_size} does not divide the model's {num_heads} attention heads; "
            f"choose a divisor of {num_heads}"
        )
    if world_size <= num_kv_heads and num_kv_heads % world_size:
        raise ValueError(
            f"--tensor-parallel-size {world_size} does not divide the model's {num_kv_heads} KV heads; "
            f"choose a divisor of {num_kv_heads}, or a multiple of it (each KV head then replicated)"
        )
    if world_size > num_kv_heads and world_size % num_kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {world_size} is more than the model's {num_kv_heads} KV heads and not a "
            f"multiple of them, so they cannot be replicated evenly; choose a multiple of {num_kv_heads}"
        )
    if intermediate_size % world_size:
        raise ValueError(
            f"--tensor-parallel-size {world_size} does not divide the model's MLP width {intermediate_size}"
        )
    if vocab_size < world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} is more than the vocabulary ({vocab_size} tokens)")
