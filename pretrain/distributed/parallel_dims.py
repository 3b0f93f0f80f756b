"""The (data-parallel x sequence-parallel) mesh, and the loss of a sequence-parallel piece.

With `engine.sequence_parallel: N` the W ranks form W/N sequence groups of N consecutive ranks (so
a group sits on one node). The ranks of a group read the same samples: the data loader runs at the
data-parallel rank and size, so its exact-resume state is that of a W/N-rank run and reshards when N
or W change. Each rank keeps its contiguous slice [r*L/N, (r+1)*L/N) of the inputs and of the
already-shifted labels, so no label is lost at a slice border.

Loss and gradients. A rank's loss is the cross-entropy summed over its slice divided by the
non-ignored tokens of the whole micro-batch (counted over its group), so the group's losses sum to
the micro-batch mean. Every engine here averages gradients over all W ranks, treating them as data
parallel (DeepSpeed is given no sequence-parallel group, so ZeRO stages 0-3 all divide by W; FSDP2
divides by its W-rank mesh): the loss is multiplied by N to turn that division into the division by
the W/N data-parallel ranks that the same global batch without sequence parallelism gets. The mean of
the reported per-rank losses over all W ranks is then the global batch's mean loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import CausalLM, SequenceParallel
from pretrain.config import ConfigError, RunConfig
from pretrain.distributed.process_group import new_group


@dataclass(frozen=True)
class ParallelDims:
    """World size W = data_parallel x sequence_parallel; rank = dp_rank * sequence_parallel + sp_rank."""

    world: int
    sequence_parallel: int

    def __post_init__(self) -> None:
        if self.world % self.sequence_parallel:
            raise ConfigError(
                f"engine.sequence_parallel={self.sequence_parallel} does not divide the world size {self.world}: "
                f"sequence groups are {self.sequence_parallel} consecutive ranks, so the number of ranks must be "
                f"a multiple of it"
            )

    @property
    def data_parallel(self) -> int:
        return self.world // self.sequence_parallel

    def dp_rank(self, rank: int) -> int:
        return rank // self.sequence_parallel

    def sp_rank(self, rank: int) -> int:
        return rank % self.sequence_parallel

    def build(self, rank: int, seq_len: int) -> SequenceParallel | None:
        """Create the sequence groups (every rank creates every group, as torch.distributed requires)
        and return this rank's context; None without sequence parallelism."""
        n = self.sequence_parallel
        if n == 1:
            return None
        mine = None
        for first in range(0, self.world, n):
            group = new_group(list(range(first, first + n)))
            if first <= rank < first + n:
                mine = group
        sp_rank = self.sp_rank(rank)
        return SequenceParallel(group=mine, rank=sp_rank, size=n, offset=sp_rank * (seq_len // n))


def dims_for(cfg: RunConfig, world: int) -> ParallelDims:
    return ParallelDims(world, cfg.engine.sequence_parallel)


def local_slice(tokens: torch.Tensor, sp: SequenceParallel | None) -> torch.Tensor:
    """This rank's contiguous piece [r*L/N, (r+1)*L/N) of a [B, L] batch (the whole batch without SP)."""
    if sp is None:
        return tokens
    piece = tokens.shape[1] // sp.size
    return tokens[:, sp.rank * piece : (sp.rank + 1) * piece]


def sequence_parallel_loss(
    model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor, sp: SequenceParallel,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """N x (this piece's summed cross-entropy) / (non-ignored tokens of the whole micro-batch), plus the
    model's auxiliary loss (the whole sequence's on every rank, CausalLM.auxiliary_loss); ``doc_start``
    is this piece's slice of the document starts (data.doc_boundaries)."""
    total, count, _ = model.summed_loss(input_ids, labels, sequence_parallel=sp, doc_start=doc_start)
    count = count.to(total.dtype)
    dist.all_reduce(count, group=sp.group)
    loss, auxiliary = total * sp.size / count.clamp_min(1.0), model.auxiliary_loss()
    return loss if auxiliary is None else loss + auxiliary
