"""Write collisions of PMNet's phasor memory: how many writers share a slot, and the 1/sqrt(s) scaling.

A slot written by s tokens in one scope (a segment, or a document over the whole sequence) scales
each write by 1/sqrt(s), so a busy slot's phase does not run away. The counts are made by sorting,
so no buffer is sized by a count read on the host; under sequence parallelism one all-gather shares
the counts of the documents that cross the pieces' borders. docs/pmnet.md ("Memory") explains why.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def scale_gradient(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Value x exactly, gradient scaled by `scale`: sg(x) + (scale*x - sg(scale*x)).

    This is the stop-gradient construction x*scale + sg(x - x*scale) rearranged so that the forward
    value is bit-identical to x (y - y is exactly zero in floating point).
    """
    scaled = x * scale
    return x.detach() + (scaled - scaled.detach())


def collision_counts(slots: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Writers per slot: (counts [B, n_slots], s [B, T, L] = writers of the slot each write goes to).

    Counted over the tokens of `slots` [B, T, L] in each batch row (one segment).
    """
    B = slots.shape[0]
    flat = slots.reshape(B, -1)
    counts = torch.zeros(B, n_slots, device=slots.device, dtype=torch.float32)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts, counts.gather(1, flat).view(slots.shape)


def key_counts(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For keys (long [B, K]): how often each entry's key occurs in its row (float32 [B, K]), and a mask
    true at exactly one entry of each distinct key of a row (bool [B, K]). Counted by sorting, so nothing
    is sized by the largest key (a number of documents or segments only the host could read)."""
    ordered, order = keys.sort(dim=1)
    lo = torch.searchsorted(ordered, ordered, side="left")
    hi = torch.searchsorted(ordered, ordered, side="right")
    counts = torch.empty(keys.shape, dtype=torch.float32, device=keys.device).scatter_(1, order, (hi - lo).float())
    first = lo == torch.arange(keys.shape[1], device=keys.device)
    return counts, torch.zeros_like(first).scatter_(1, order, first)


def normalise_collisions(delta: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Segment-aware gradient normalisation of writes delta [B, T, L, M] going to slots [B, T, L] (any
    ids: one per (segment, slot) in the model).

    Forward value unchanged; the gradient of each write divided by sqrt(s), s = the number of
    writers of its slot among these tokens: dM_eff = dM/sqrt(s) + sg(dM - dM/sqrt(s)).
    """
    s, _ = key_counts(slots.reshape(slots.shape[0], -1))
    return scale_gradient(delta, s.view(slots.shape).rsqrt()[..., None])


class SequenceCollisions:
    """The same normalisation with s counted over a whole call (several segments), each document apart,
    and over every piece of a sequence-parallel group.

    A segment's writes enter the scan before later segments are routed, so their s is known only
    at the end of the forward pass; `finish` then attaches the 1/sqrt(s) factor as a gradient hook
    on each batch of writes. Forward values are untouched; the gradient is the one of the
    stop-gradient construction with the sequence's counts.
    """

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, delta: torch.Tensor, slots: torch.Tensor, documents: torch.Tensor | None = None) -> None:
        """Writes delta [B, T, L, M] to slots [B, T, L] by tokens of ``documents`` (long [B, T], numbered as
        `model.blocks.document_ids` numbers a call's; None: all of one document)."""
        if documents is None:
            documents = torch.zeros(slots.shape[:2], dtype=torch.long, device=slots.device)
        self.pending.append((delta, slots, documents[..., None].expand(slots.shape)))

    def finish(self, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False) -> None:
        """Attach the 1/sqrt(s) gradient factors; a sequence-parallel piece counts over all pieces."""
        if not self.pending:
            return
        slots = torch.cat([slots for _, slots, _ in self.pending], dim=1)
        documents = torch.cat([documents for _, _, documents in self.pending], dim=1)
        counts, _ = key_counts((documents * self.n_slots + slots).reshape(slots.shape[0], -1))
        counts = counts.view(slots.shape)
        if sequence_parallel:
            counts = counts + writers_in_other_pieces(slots, documents, self.n_slots, group)
        start = 0
        for delta, part, _ in self.pending:
            if delta.requires_grad:
                scale = counts[:, start : start + part.shape[1]].rsqrt()[..., None]
                delta.register_hook(lambda grad, scale=scale: grad * scale)
            start += part.shape[1]
        self.pending = []


def writers_in_other_pieces(
    slots: torch.Tensor, documents: torch.Tensor, n_slots: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Per write to slots [B, T, L] by a token of documents [B, T, L] (this piece's numbering, 0 for the
    document that entered it): the writers of the same (document, slot) in the other pieces of ``group``.

    Only two documents of a piece cross its borders: its first (number 0, begun in an earlier piece)
    and its last (going on into later ones; the same document when the piece starts none). One
    all-gather shares each piece's per-slot writers of both and whether it starts a document; each rank
    then walks back to the last earlier piece that starts one, and forward to the first later one."""
    B, n = slots.shape[0], n_slots
    flat, docs = slots.reshape(B, -1), documents.reshape(B, -1)
    last = docs.amax(1, keepdim=True)  # [B, 1]: the documents this piece starts
    in_first, in_last = (docs == 0).float(), (docs == last).float()
    head = torch.zeros(B, n, device=slots.device).scatter_add_(1, flat, in_first)
    tail = torch.zeros(B, n, device=slots.device).scatter_add_(1, flat, in_last)
    mine = torch.cat((head, tail, (last > 0).float()), dim=1)  # [B, 2n + 1]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rank = dist.get_rank(group)
    before, after = torch.zeros(B, n, device=slots.device), torch.zeros(B, n, device=slots.device)
    reach = torch.ones(B, 1, device=slots.device)
    for piece in every[:rank][::-1]:  # back: whole pieces, then the last document of one that starts one
        starts = piece[:, 2 * n :]
        before = before + reach * torch.where(starts > 0, piece[:, n : 2 * n], piece[:, :n])
        reach = reach * (1 - starts)
    reach = torch.ones(B, 1, device=slots.device)
    for piece in every[rank + 1 :]:  # forward: the first document of each piece up to one that starts one
        after = after + reach * piece[:, :n]
        reach = reach * (1 - piece[:, 2 * n :])
    return (before.gather(1, flat) * in_first + after.gather(1, flat) * in_last).view(slots.shape)
