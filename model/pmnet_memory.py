"""The hierarchical unit-phasor memory of PMNet: tree routing, phase writes, demodulated reads.

Each token walks one root-to-leaf path of a tree of phase slots, reads every slot on it and adds its
write to each; the scan itself is `kernels.phasor_scan`. Routing sees the memory as it stood at the
start of the token's segment, so a segment's routes are computed in parallel while reads stay
token-exact; writes carry the 1/sqrt(s) collision normalisation. docs/pmnet.md ("Memory" and its
decisions) explains the choices; docs/sequence_parallel.md ("Models") why this memory is relayed
between ranks rather than combined like the plain scan.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import kernels
from kernels.parallel import receive_from_previous, send_to_next
from model.config import PMNetConfig
from model.interface import SequenceParallel


class MemoryState(NamedTuple):
    """Phases [B, n_slots, memory_dim] after the last token, and at the start of its segment."""

    memory: torch.Tensor
    segment_memory: torch.Tensor


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


def normalise_collisions(delta: torch.Tensor, slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    """Segment-aware gradient normalisation of writes delta [B, T, L, M] going to slots [B, T, L].

    Forward value unchanged; the gradient of each write divided by sqrt(s), s = the number of
    writers of its slot among these tokens: dM_eff = dM/sqrt(s) + sg(dM - dM/sqrt(s)).
    """
    _, s = collision_counts(slots, n_slots)
    return scale_gradient(delta, s.rsqrt()[..., None])


class SequenceCollisions:
    """The same normalisation with s counted over a whole call (several segments).

    A segment's writes enter the scan before later segments are routed, so their s is known only
    at the end of the forward pass; `finish` then attaches the 1/sqrt(s) factor as a gradient hook
    on each segment's writes. Forward values are untouched; the gradient is the one of the
    stop-gradient construction with the sequence's counts.
    """

    def __init__(self, batch: int, n_slots: int, device: torch.device | str):
        self.n_slots = n_slots
        self.counts = torch.zeros(batch, n_slots, device=device)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, delta: torch.Tensor, slots: torch.Tensor) -> None:
        """Count the writes of one segment (delta [B, T, L, M] to slots [B, T, L])."""
        self.counts += collision_counts(slots, self.n_slots)[0]
        if delta.requires_grad:
            self.pending.append((delta, slots))

    def finish(self, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False) -> None:
        """Attach the 1/sqrt(s) gradient factors; a sequence-parallel piece counts over all pieces."""
        if sequence_parallel:
            dist.all_reduce(self.counts, group=group)
        for delta, slots in self.pending:
            scale = self.counts.gather(1, slots.reshape(slots.shape[0], -1)).view(slots.shape).rsqrt()[..., None]
            delta.register_hook(lambda grad, scale=scale: grad * scale)
        self.pending = []


def straight_through_one(p: torch.Tensor) -> torch.Tensor:
    """1 in value, with the gradient of p: the weight that makes a hard choice trainable."""
    return 1.0 + (p - p.detach())


class PhasorMemory(nn.Module):
    """One block's phasor memory. Input: the pre-normed hidden states; output: a residual update.

    `reference = True` switches to the sequential reference (token-by-token routing and scan with
    kernels.phasor_scan(backend="reference")); tests compare it with the fast path.
    """

    def __init__(self, d_model: int, config: PMNetConfig):
        super().__init__()
        memory_dim, branching, depth = config.memory_dim, config.branching, config.depth
        self.memory_dim, self.branching, self.depth = memory_dim, branching, depth
        self.n_levels, self.n_slots = depth + 1, config.n_slots
        self.segment_len, self.temperature = config.segment_len, config.route_temperature
        self.update_train, self.update_eval = config.update_memory_train, config.update_memory_eval
        self.collision_scope, self.scan_backend = config.collision_scope, config.scan_backend
        self.reference = False
        offsets = [(branching**h - 1) // (branching - 1) for h in range(depth + 1)]
        self.register_buffer("level_offsets", torch.tensor(offsets), persistent=False)
        self.query = nn.Linear(d_model, memory_dim, bias=False)
        self.write = nn.Linear(d_model, memory_dim, bias=False)
        self.out = nn.Linear(self.n_levels * 2 * memory_dim, d_model, bias=False)
        # A complex anchor per slot (real and imaginary halves), comparable in size to a unit phasor
        # state so that, at the start when every state is 0, the anchors alone separate siblings.
        self.anchors = nn.Parameter(torch.randn(self.n_slots, 2 * memory_dim))
        self.last_write_grad_sq: torch.Tensor | None = None
        self.slot_writes = torch.zeros(self.n_slots)
        self.slot_segments = torch.zeros(self.n_slots)
        # Diagnostics (PMNet.record_routes): each forward keeps every token's path and, per routed level,
        # the gap between the best and second-best child's score.
        self.record_routes = False
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> MemoryState:
        zeros = torch.zeros(batch_size, self.n_slots, self.memory_dim, device=device, dtype=torch.float32)
        return MemoryState(zeros, zeros)

    def slot_keys(self, segment_memory: torch.Tensor) -> torch.Tensor:
        """Unit routing keys [B, n_slots, 2M]: the slot's state as a phasor plus its anchor, normalised."""
        keys = torch.cat((segment_memory.cos(), segment_memory.sin()), dim=-1) + self.anchors.float()
        return keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-6)

    def route(self, query_phasor: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Walk the tree: slots [B, T, L] on each token's path and straight-through gates [B, T, L].

        query_phasor [B, T, 2M] has unit norm; keys [B, n_slots, 2M]. At each level only the current
        node's `branching` children are scored (O(depth * branching) per token); the forward choice
        is the argmax, the gate is 1 in value with the gradient of the chosen child's softmax weight.
        """
        B, T, _ = query_phasor.shape
        batch = torch.arange(B, device=keys.device)[:, None, None]
        children_local = torch.arange(self.branching, device=keys.device)
        node = torch.zeros(B, T, dtype=torch.long, device=keys.device)
        slots = [node]
        gates = [query_phasor.new_ones(B, T)]
        margins: list[torch.Tensor] = []
        for level in range(1, self.n_levels):
            children = node[..., None] * self.branching + children_local  # local ids at this level
            child_keys = keys[batch, self.level_offsets[level] + children]  # [B, T, N, 2M]
            scores = torch.einsum("btd,btnd->btn", query_phasor, child_keys)
            probs = torch.softmax(scores / self.temperature, dim=-1)
            choice = scores.argmax(dim=-1)
            if self.record_routes:
                best_two = scores.detach().topk(2, dim=-1).values
                margins.append(best_two[..., 0] - best_two[..., 1])
            gates.append(straight_through_one(probs.gather(-1, choice[..., None]).squeeze(-1)))
            node = node * self.branching + choice
            slots.append(self.level_offsets[level] + node)
        if self.record_routes:
            self.recorded.append((torch.stack(slots, dim=-1), torch.stack(margins, dim=-1)))
        return torch.stack(slots, dim=-1), torch.stack(gates, dim=-1)

    def _record_write_grad(self, grad: torch.Tensor) -> None:
        self.last_write_grad_sq = grad.detach().float().pow(2).sum()

    def forward(
        self, h: torch.Tensor, state: MemoryState, position: int, sequence_parallel: SequenceParallel | None = None
    ) -> tuple[torch.Tensor, MemoryState]:
        """Read and write the memory for h [B, T, d] at absolute positions position.. ; a
        sequence-parallel piece takes its entering state from the previous rank (relay)."""
        B, T, _ = h.shape
        L, M = self.n_levels, self.memory_dim
        sp = sequence_parallel
        phase_q = self.query(h).float()
        if self.update_train if self.training else self.update_eval:
            increment = self.write(h).float()
            if increment.requires_grad:
                increment.register_hook(self._record_write_grad)
        else:
            increment = phase_q.new_zeros(B, T, M)
        if sp is not None:  # after the projections: sharded engines gather their weights collectively
            if position % self.segment_len or T % self.segment_len:
                raise ValueError(f"sequence-parallel pieces must be whole segments of {self.segment_len} tokens")
            phase_q, received = receive_from_previous(state.memory, phase_q, sp.group)
            if received is not None:
                state = MemoryState(received, received)
        with torch.autocast(h.device.type, enabled=False):  # phases, routing scores and reads stay fp32
            features, state, sequence = self._segments(phase_q, increment, state, position)
        if sp is not None:  # before the collision counts' all-reduce, which the next rank reaches after this
            features = send_to_next(state.memory, features, sp.group)
        if sequence is not None:
            sequence.finish(None if sp is None else sp.group, sp is not None)
        return self.out(features.reshape(B, T, L * 2 * M).to(h.dtype)), state

    def _segments(
        self, phase_q: torch.Tensor, increment: torch.Tensor, state: MemoryState, position: int
    ) -> tuple[torch.Tensor, MemoryState, SequenceCollisions | None]:
        """Route, write and read segment by segment: features [B, T, L, 2M], the new state, and the
        sequence-scope collision counts still to be attached (None with segment scope)."""
        B, T, M = phase_q.shape
        L = self.n_levels
        query_phasor = torch.cat((phase_q.cos(), phase_q.sin()), dim=-1) / math.sqrt(M)
        memory, segment_memory = state
        writes = torch.zeros(self.n_slots, device=phase_q.device)
        segments = torch.zeros(self.n_slots, device=phase_q.device)
        sequence = SequenceCollisions(B, self.n_slots, phase_q.device) if self.collision_scope == "sequence" else None
        features = []
        start = 0
        while start < T:
            into_segment = (position + start) % self.segment_len
            if into_segment == 0:
                segment_memory = memory
            stop = min(T, start + self.segment_len - into_segment)
            keys = self.slot_keys(segment_memory)
            if self.reference:
                routed = [self.route(query_phasor[:, t : t + 1], keys) for t in range(start, stop)]
                slots = torch.cat([r[0] for r in routed], dim=1)
                gates = torch.cat([r[1] for r in routed], dim=1)
            else:
                slots, gates = self.route(query_phasor[:, start:stop], keys)
            delta = increment[:, start:stop, None, :].expand(B, stop - start, L, M)
            if sequence is not None:
                sequence.add(delta, slots)
            elif self.collision_scope == "segment":
                delta = normalise_collisions(delta, slots, self.n_slots)
            if self.reference:
                reads = []
                for t in range(stop - start):
                    read, memory = kernels.phasor_scan(
                        delta[:, t : t + 1], slots[:, t : t + 1], self.n_slots,
                        initial_state=memory, output_final_state=True, backend="reference",
                    )
                    reads.append(read)
                read = torch.cat(reads, dim=1)
            else:
                read, memory = kernels.phasor_scan(
                    delta, slots, self.n_slots, initial_state=memory, output_final_state=True, backend=self.scan_backend
                )
            demod = read - phase_q[:, start:stop, None, :]
            features.append(torch.cat((demod.cos(), demod.sin()), dim=-1) * gates[..., None])
            with torch.no_grad():
                counts, _ = collision_counts(slots, self.n_slots)
                writes += counts.sum(0)
                segments += (counts > 0).sum(0)
            start = stop
        self.slot_writes, self.slot_segments = writes, segments
        return torch.cat(features, dim=1), MemoryState(memory, segment_memory), sequence
