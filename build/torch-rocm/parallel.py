"""Vocabulary parallelism: weight (and bias, class_weight) are this rank's contiguous shard of the
vocabulary, ranks in group order; targets hold global class ids. Communication is torch.distributed
(NCCL on GPUs, gloo on CPU): a few all-reduces of O(N) numbers per pass, never a (N, V) tensor.

Forward: each rank sweeps its shard; per row it has its shard's lse_r, target logit (0 where another
shard holds the target), sum of w z, and the entropy's E_r[z] = lse_r - entropy_r, best logit and
its global id. Merged with MAX (lse, best), SUM (exp(lse_r - lse_max) [x E_r[z]], target logit,
sum w z) and MIN (the global id among the shards that hold the global best: first index on ties).
Backward: each rank forms da on its shard from the global lse; grad_weight / grad_bias are its
shard's; the partial grad_hidden (da_r @ weight_r) is all-reduced in fp32 here, so every rank gets
the full grad_hidden: do not reduce it again.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

_GROUPS: dict[int, object] = {}


@dataclass(frozen=True)
class Shard:
    group: object
    rank: int
    world: int
    v_local: int

    @property
    def offset(self) -> int:
        return self.rank * self.v_local

    @property
    def v_total(self) -> int:
        return self.world * self.v_local


def register(group) -> int:
    """A small int that names ``group`` inside custom-op arguments (0: no group)."""
    key = id(group)
    _GROUPS[key] = group
    return key


def shard_for(group_id: int, v_local: int) -> Shard | None:
    if group_id == 0:
        return None
    group = _GROUPS[group_id]
    return Shard(group, dist.get_rank(group), dist.get_world_size(group), v_local)


def start_size_check(shard: Shard, device) -> torch.Tensor:
    """The first collective of every vocabulary-parallel forward: the largest and the negated
    smallest shard size over the group (one all-reduce of two integers). Every rank takes it on
    every call, whatever its size, so ranks with unequal shards never wait in different
    collectives; ``finish_size_check`` reads it once the forward's work is queued."""
    sizes = torch.full((2,), shard.v_local, dtype=torch.int64, device=device)  # a fill: graph-capturable
    sizes[1].neg_()
    return all_reduce(sizes, shard, dist.ReduceOp.MAX)


def finish_size_check(sizes: torch.Tensor, shard: Shard) -> None:
    """Raises on every rank unless every rank holds the same number of vocabulary rows. The one host
    read of the vocabulary-parallel path, taken after the forward's kernels and collectives are
    queued (the ranks' statistics were all-reduced with the same shapes: they depend on N only).
    Not while a CUDA graph is being captured, where no host read is allowed: the eager warm-up
    calls that capture needs have checked the same sizes, and the replays keep them."""
    if sizes.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    largest, negated_smallest = sizes.tolist()
    smallest = -negated_smallest
    if largest != smallest:
        raise ValueError(
            f"vocabulary shards must have equal sizes across the process group: this rank holds "
            f"{shard.v_local} rows, the group's shards range from {smallest} to {largest}"
        )


def all_reduce(t: torch.Tensor, shard: Shard, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(t, op=op, group=shard.group)
    return t


def merge_stats(stats, shard: Shard, metrics: bool):
    """The per-row statistics of the whole vocabulary from each rank's shard (module docstring)."""
    row_max, log_sum = stats.lse2[0], stats.lse2[1]
    top = torch.stack([row_max, stats.best]) if metrics else row_max[None].clone()
    all_reduce(top, shard, dist.ReduceOp.MAX)
    new_max = top[0]
    scale = torch.exp((row_max - new_max) + log_sum)  # this shard's share of sum exp(z - new_max)
    parts = [scale, stats.z_target]
    if metrics:  # share of sum exp(z - new_max) (z - new_max): the shard's mean logit less new_max
        parts.append(scale * (((row_max - new_max) + log_sum) - stats.entropy))
    if stats.wz is not None:
        parts.append(stats.wz)
    if stats.squares is not None:  # this shard's share of sum exp(2 (z - new_max))
        parts.append(torch.exp(2.0 * (row_max - new_max)) * stats.squares)
    sums = all_reduce(torch.stack(parts), shard)
    stats.lse2[0].copy_(new_max)
    stats.lse2[1].copy_(torch.log(sums[0]))
    stats.z_target.copy_(sums[1])
    if stats.squares is not None:
        stats.squares.copy_(sums[-1])
    if stats.wz is not None:
        stats.wz.copy_(sums[-2] if stats.squares is not None else sums[-1])
    if metrics:
        stats.entropy.copy_(stats.lse2[1] - sums[2] / sums[0])
        holds_best = stats.best == top[1]
        idx = torch.where(holds_best, stats.argmax, torch.full_like(stats.argmax, torch.iinfo(torch.int64).max))
        stats.argmax.copy_(all_reduce(idx, shard, dist.ReduceOp.MIN))
        stats.best.copy_(top[1])
    return stats
