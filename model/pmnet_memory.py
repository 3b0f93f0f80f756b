"""The hierarchical unit-phasor memory of PMNet: tree routing, phase writes, demodulated reads.

Each token walks one root-to-leaf path of a tree of phase slots, reads every slot on it and adds its
bounded write to each; the scan itself is `kernels.phasor_scan`. Routing compares the token's query
with the slots' learned anchors only, so every route of a call is computed at once and one scan call
serves the whole call; in training the backward also sees the reads of the children not picked
(a softmax-weighted mixture whose forward value is exactly zero). Writes carry the 1/sqrt(s)
collision normalisation, and the output projection starts at zero, so a new memory is a no-op.
docs/pmnet.md ("Memory" and its decisions) explains the choices; docs/sequence_parallel.md
("Models") how a sequence-parallel piece combines the other pieces' phases.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

import kernels
from kernels.parallel import exchange_with_neighbours, phasor_scan_sequence_parallel, sum_over_ranks
from model.blocks import Offset, document_ids, token_positions
from model.config import PMNetConfig
from model.interface import SequenceParallel
from model.pmnet_collisions import (
    SequenceCollisions,
    collision_counts,
    key_counts,
    normalise_collisions,
)


class MemoryState(NamedTuple):
    """Phases [B, n_slots, memory_dim] after the last token; with `write_address: previous`, also the
    last token's routing phases [B, memory_dim] (the next token writes on their path)."""

    memory: torch.Tensor
    previous: torch.Tensor | None = None


def interleave(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] and [B, T, ...] -> [B, 2T, ...]: first[:, t] at 2t, second[:, t] at 2t + 1."""
    return torch.stack((first, second), dim=2).flatten(1, 2)


def unit_phasor(phase: torch.Tensor) -> torch.Tensor:
    """Phases [..., M] -> the unit vector [cos, sin] / sqrt(M) [..., 2M] that routing compares with keys."""
    return torch.cat((phase.cos(), phase.sin()), dim=-1) / math.sqrt(phase.shape[-1])


def child_scores(phasor: torch.Tensor, keys: torch.Tensor, child_slots: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each token's phasor [B, T, 2M] with the keys of its candidate slots
    child_slots [B, T, ...N] (a level's children, or every routed level's): [B, T, ...N]."""
    candidates = keys[child_slots]
    return torch.einsum("btd,bt...d->bt...", phasor, candidates)


def straight_through_mixture(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """hard in value (bit for bit: soft - soft is exactly 0), with the gradients of hard plus soft."""
    return hard + (soft - soft.detach())


class PhasorMemory(nn.Module):
    """One block's phasor memory. Input: the pre-normed hidden states; output: a residual update.

    `reference = True` switches to the sequential reference (token-by-token routing and scan with
    kernels.phasor_scan(backend="reference")); tests compare it with the fast path.
    """

    def __init__(self, d_model: int, config: PMNetConfig):
        super().__init__()
        memory_dim, branching, depth = config.memory_dim, config.branching, config.depth
        self.d_model, self.memory_dim, self.branching, self.depth = d_model, memory_dim, branching, depth
        self.n_levels, self.n_slots = depth + 1, config.n_slots
        self.segment_len, self.temperature = config.segment_len, config.route_temperature
        self.horizon = config.memory_horizon
        self.update_train, self.update_eval = config.update_memory_train, config.update_memory_eval
        self.collision_scope, self.scan_backend = config.collision_scope, config.scan_backend
        self.routing, self.write_address = config.routing, config.write_address
        # every routing but the fixed hash learns: anchors as parameters, a learned write address, the
        # sibling mixture that gives the routes their gradient
        self.learns_routes = config.routing != "hash"
        self.balance_weight = config.balance_loss
        self.reference = False
        offsets = [(branching**h - 1) // (branching - 1) for h in range(depth + 1)]
        self.register_buffer("level_offsets", torch.tensor(offsets), persistent=False)
        self.level_starts = tuple(offsets)  # the same on the host: the balance loss reads no tensor
        self.query = nn.Linear(d_model, memory_dim, bias=False)
        self.write = nn.Linear(d_model, memory_dim, bias=False)
        # `write_address: conv` (learned routing): the writes' own address, from the short-convolved input
        learned_address = config.write_address == "conv" and self.learns_routes
        self.address = nn.Linear(d_model, memory_dim, bias=False) if learned_address else None
        # `routing: router`: the reads' route from a projection of its own, so what moves the route (the
        # balance loss above all) does not move the query phases that demodulate the read
        self.router = nn.Linear(d_model, memory_dim, bias=False) if config.routing == "router" else None
        # Per-component gain of the writes, inside the squash; zero at first, so the memory starts
        # static (docs/pmnet.md, "writes start at zero").
        self.write_gain = nn.Parameter(torch.zeros(memory_dim))
        self.out = nn.Linear(self.n_levels * 2 * memory_dim, d_model, bias=False)
        # A learned routing key per slot in the space of the query phasor [cos, sin]: routing compares
        # queries with these alone (docs/pmnet.md, "routing on the anchors").
        anchors = torch.randn(self.n_slots, 2 * memory_dim)
        if self.learns_routes:
            self.anchors = nn.Parameter(anchors)
        else:  # fixed: a random projection of the input against fixed keys
            self.register_buffer("anchors", anchors)
            self.register_buffer("hash_projection", torch.randn(d_model, memory_dim))
        # The Switch-style balance loss of the last training forward (a scalar with its graph).
        self.balance: torch.Tensor | None = None
        self.last_write_grad_sq: torch.Tensor | None = None
        self.slot_writes = torch.zeros(self.n_slots)
        self.slot_segments = torch.zeros(self.n_slots)
        # Diagnostics (PMNet.record_routes): each forward keeps every token's path and, per routed level,
        # the gap between the best and second-best child's score.
        self.record_routes = False
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def init_weights(self) -> None:
        """The memory's own initialisation, applied after the model's generic one (StackedLM gives
        every Linear N(0, init_std^2)).

        Query phases ~ N(0, 1) rad per component (the input is RMS-normed): with the common 0.02 init
        every query phasor sits near [1, 0], all tokens route alike and pile onto one leaf. The output
        projection starts at zero, so at initialisation the block computes exactly what it computes
        without the memory; the memory's read enters the residual stream only as training finds it
        useful (a full-scale read of nearly random phases is noise the rest of the network must first
        learn to drown). The write gain is created at zero (write_increments says why).

        A router of its own (`routing: router`) starts at pi times the query's scale: its phases are
        then ~N(0, pi^2), nearly uniform on the circle, where N(0, 1) phases give every phasor a common
        component (E cos phi = e^(-1/2) = 0.61) that sends most tokens to the same children (on the
        books model at initialisation: balance loss 5.3 and level-1 child-use entropy 0.58 of the
        maximum at N(0, 1), 1.22 and 0.99 at N(0, pi^2); docs/pmnet.md, "Why a router of its own").
        """
        nn.init.normal_(self.query.weight, std=self.d_model**-0.5)
        if self.address is not None:  # the same reason: the write addresses must spread from the start
            nn.init.normal_(self.address.weight, std=self.d_model**-0.5)
        if self.router is not None:
            nn.init.normal_(self.router.weight, std=math.pi * self.d_model**-0.5)
        nn.init.zeros_(self.out.weight)

    def routing_parameters(self) -> list[str]:
        """Names of the learned anchors, the write projection and the address and router projections
        (those `decay_routing` exempts)."""
        names = dict(self.named_parameters())
        return [name for name in ("anchors", "write.weight", "address.weight", "router.weight") if name in names]

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> MemoryState:
        memory = torch.zeros(batch_size, self.n_slots, self.memory_dim, device=device, dtype=torch.float32)
        previous = None
        if self.write_address == "previous":
            previous = torch.zeros(batch_size, self.memory_dim, device=device, dtype=torch.float32)
        return MemoryState(memory, previous)

    def routing_phases(self, h: torch.Tensor, phase_q: torch.Tensor) -> torch.Tensor:
        """The phases [B, T, M] (fp32) that route each token: its query's (`routing: learned`), the
        router's projection of h (`router`), or a fixed random projection of h (`hash`)."""
        if self.routing == "hash":
            return h.float() @ (self.hash_projection.float() * self.d_model**-0.5)
        if self.router is not None:
            return self.router(h).float()
        return phase_q

    def address_phases(self, a: torch.Tensor) -> torch.Tensor:
        """The phases [B, T, M] (fp32) that route the writes under `write_address: conv`: a projection of
        its own of the short-convolved input a, which holds the tokens before each one (a value token's
        holds its key), or the fixed hash of a under `routing: hash`."""
        return self.routing_phases(a, None if self.address is None else self.address(a).float())

    def previous_phases(
        self, phase_r: torch.Tensor, carried: torch.Tensor | None, sp: SequenceParallel | None,
        restart: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's predecessor's routing phases [B, T, M] (zeros where ``restart`` (bool [B, T]:
        document starts, horizon ends) and before the first token of all), and the last token's, to
        carry. A sequence-parallel piece gets its first predecessor from the previous rank. No
        gradient: a write's path is discrete."""
        phase_r = phase_r.detach()
        last = phase_r[:, -1]
        if sp is not None:
            _, carried = exchange_with_neighbours(last[:, None].contiguous(), sp.group)
            carried = None if carried is None else carried[:, 0]
        if carried is None:
            carried = torch.zeros_like(last)
        shifted = torch.cat((carried[:, None].to(phase_r.dtype), phase_r[:, :-1]), dim=1)
        if restart is not None:
            shifted = torch.where(restart[..., None], 0.0, shifted)
        return shifted, last

    def balance_loss(
        self, path: torch.Tensor, children: torch.Tensor, weights: torch.Tensor, sp: SequenceParallel | None = None
    ) -> torch.Tensor:
        """Switch-style load balance, averaged over the routed levels: n_l * sum_i f_i * P_i over the
        n_l slots of level l, with f_i the share of tokens whose path takes slot i and P_i the mean
        softmax weight slot i gets among its siblings (1 when every slot of a level is used alike).

        Only P carries a gradient (f counts argmax choices). A sequence-parallel piece sums both over
        the group in one differentiable all-reduce (`sum_over_ranks`), so every rank gets the whole
        sequence's loss and its P the whole loss's gradient (in the N x convention of the pieces' LM loss).
        """
        B, T, _ = path.shape
        used, weight = [], []
        for level in range(1, self.n_levels):
            start, width = self.level_starts[level], self.branching**level
            chosen = (path[:, :, level] - start).reshape(-1)
            ones = torch.ones_like(chosen, dtype=torch.float32)
            used.append(torch.zeros(width, device=path.device).index_add_(0, chosen, ones))
            slots, soft = (children[:, :, level - 1] - start).reshape(-1), weights[:, :, level - 1].reshape(-1)
            weight.append(torch.zeros(width, device=path.device).index_add_(0, slots, soft))
        f, p = torch.cat(used), torch.cat(weight)
        tokens = float(B * T)
        if sp is not None:  # equal pieces (SequenceParallel): the whole sequence has N x the tokens
            f, p = sum_over_ranks(torch.stack((f, p)), sp.group).unbind(0)
            tokens *= sp.size
        losses = []
        for level in range(1, self.n_levels):
            start, width = self.level_starts[level] - 1, self.branching**level
            losses.append(width * (f[start : start + width] / tokens * p[start : start + width] / tokens).sum())
        return torch.stack(losses).mean()

    def write_increments(self, h: torch.Tensor) -> torch.Tensor:
        """Phase increments pi * tanh(g * W_w h), fp32 [B, T, M]: every component in (-pi, pi).

        A phase is known only modulo 2*pi, so an increment beyond +-pi is indistinguishable from a
        smaller one of the other sign; the squash keeps each write inside the range where the phase
        it adds is the one the gradient sees, and bounds how far one token can turn a slot. The gain
        g (one per component, starting at 0) lets the writes grow only as far as they help: each
        component's gain is moved by the gradient summed over every token and slot, where the
        write weights' own gradients are mostly noise that Adam would turn into steps of full size.
        """
        return math.pi * torch.tanh(self.write_gain.float() * self.write(h).float())

    def slot_keys(self) -> torch.Tensor:
        """Unit routing keys [n_slots, 2M]: the anchors, normalised (fp32)."""
        keys = self.anchors.float()
        return keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-6)

    def route(self, query_phasor: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Walk the tree: slots [B, T, L] on each token's path, and per routed level the slots of all
        the children the token chose among [B, T, L-1, N] with their softmax weights [B, T, L-1, N].

        query_phasor [B, T, 2M] has unit norm; keys [n_slots, 2M]. At each level only the current
        node's `branching` children are scored, by cosine similarity (O(depth * branching) per token);
        the choice is the argmax.
        """
        B, T, _ = query_phasor.shape
        children_local = torch.arange(self.branching, device=keys.device)
        node = torch.zeros(B, T, dtype=torch.long, device=keys.device)
        slots, children, weights, margins = [node], [], [], []
        for level in range(1, self.n_levels):
            child_slots = self.level_offsets[level] + node[..., None] * self.branching + children_local  # [B, T, N]
            scores = child_scores(query_phasor, keys, child_slots)
            choice = scores.argmax(dim=-1)
            if self.record_routes:
                best_two = scores.detach().topk(2, dim=-1).values
                margins.append(best_two[..., 0] - best_two[..., 1])
            children.append(child_slots)
            weights.append(torch.softmax(scores / self.temperature, dim=-1))
            node = node * self.branching + choice
            slots.append(self.level_offsets[level] + node)
        path = torch.stack(slots, dim=-1)
        if self.record_routes:
            self.recorded.append((path, torch.stack(margins, dim=-1)))
        return path, torch.stack(children, dim=2), torch.stack(weights, dim=2)

    def _record_write_grad(self, grad: torch.Tensor) -> None:
        self.last_write_grad_sq = grad.detach().float().pow(2).sum()

    def forward(
        self,
        h: torch.Tensor,
        state: MemoryState,
        position: Offset,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
        address_input: torch.Tensor | None = None,
        route_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MemoryState]:
        """Read and write the memory for h [B, T, d] at positions position.. ; a sequence-parallel piece
        adds the phases of the earlier pieces (kernels.phasor_scan_sequence_parallel). With ``doc_start``
        (bool [B, T]) each document starts from the initial phases (the carried or entering phases reach only the tokens
        before a row's first start), and its segments and collision counts are its own. Under
        `write_address: conv` the writes are routed from ``address_input`` [B, T, d] (the block's
        short-convolved input; h when None). ``route_input`` [B, T, d] (h when None) is what routes the reads
        and, under `previous`, the writes (the block's `route_input`: its normed input before the
        short convolution, or the normed token embedding); h still sets the query phases that
        demodulate and the increments."""
        B, T, _ = h.shape
        L, M = self.n_levels, self.memory_dim
        sp = sequence_parallel
        phase_q = self.query(h).float()
        r = h if route_input is None else route_input
        phase_r = self.routing_phases(r, phase_q if r is h else self.query(r).float())
        # The balance loss moves the router and the anchors only, never the representation the router
        # reads: with its gradient reaching h the books model's cross-entropy was about 0.5 nats worse
        # (docs/pmnet.md, "Why a router of its own"). Under `routing: learned` it reaches the query and h.
        phase_b = None
        if self.training and self.balance_weight > 0 and self.router is not None:
            phase_b = self.router(r.detach()).float()
        phase_w, previous = None, None
        if self.write_address == "previous":  # restarts: document starts and horizon ends, as for the phases
            restart = self._resets(token_positions(position, T, doc_start, h.device), doc_start, B)
            phase_w, previous = self.previous_phases(phase_r, state.previous, sp, restart)
        elif self.write_address == "conv":
            phase_w = self.address_phases(h if address_input is None else address_input)
        if self.update_train if self.training else self.update_eval:
            increment = self.write_increments(h)
            if increment.requires_grad and not torch.compiler.is_compiling():  # a hook that sets an attribute
                increment.register_hook(self._record_write_grad)  # would break a compiled graph: eager only
        else:
            increment = phase_q.new_zeros(B, T, M)
        memory = state.memory
        if sp is not None:  # after the projections: sharded engines gather their weights collectively
            if self.collision_scope == "segment" and doc_start is not None:
                raise ValueError("collision_scope 'segment' with document starts does not run sequence-parallel "
                                 "(a document's segments cross the pieces' borders); use 'sequence'")
            if self.collision_scope == "segment" and (position % self.segment_len or T % self.segment_len):
                raise ValueError(f"sequence-parallel pieces must be whole segments of {self.segment_len} tokens")
        with torch.autocast(h.device.type, enabled=False):  # phases, routing scores and reads stay fp32
            features, memory, sequence = self._read_write(phase_q, phase_r, phase_w, increment, memory, position,
                                                          doc_start, sp, phase_b)
        if sequence is not None:
            sequence.finish(None if sp is None else sp.group, sp is not None)
        return self.out(features.reshape(B, T, L * 2 * M).to(h.dtype)), MemoryState(memory, previous)

    def _read_write(
        self,
        phase_q: torch.Tensor,
        phase_r: torch.Tensor,
        phase_w: torch.Tensor | None,
        increment: torch.Tensor,
        memory: torch.Tensor,
        position: Offset,
        doc_start: torch.Tensor | None,
        sp: SequenceParallel | None,
        phase_b: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, SequenceCollisions | None]:
        """Route every token, write and read through one scan: features [B, T, L, 2M], the phases after
        the call, and the sequence-scope collision counts still to be attached (None otherwise).
        phase_q demodulates the reads, phase_r routes them, and phase_w (None: phase_r) routes the writes;
        phase_b (None: phase_r) gives the balance loss its sibling weights on phase_r's path.

        Routing compares queries with the anchors only, never with the phases, so a document start
        needs nothing but the scan's reset: the phases go back to the initial ones there. Segments are
        fixed chunks of positions within a document, and the sequence scope counts each document's
        writers apart (across the pieces of a sequence-parallel group: `writers_in_other_pieces`).

        The scan takes each token's path with its write and, when gradients are wanted, the other
        children of every node on the path with zero increments (pure reads of the same state): the
        feature is the chosen child's demodulated read in value, and the backward also sees the
        softmax-weighted mixture of all the children's reads, so routing learns what the children it
        did not pick would have returned. Without gradients only the path is scanned; the value is the
        same bit for bit. With a write path of its own a token reads, then writes, as two steps of
        the scan (`interleave`).
        """
        B, T, M = phase_q.shape
        L, N = self.n_levels, self.branching
        keys = self.slot_keys()
        path, children, weights = self._routes(phase_r, keys)
        if self.training and self.balance_weight > 0:
            balance_weights = weights
            if phase_b is not None:
                scores = child_scores(unit_phasor(phase_b), keys, children)
                balance_weights = torch.softmax(scores / self.temperature, dim=-1)
            self.balance = self.balance_loss(path, children, balance_weights, sp)
        write_path, write_children, write_weights = path, children, None
        if phase_w is not None:  # a write route of its own: learned (conv address) or the previous token's
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.address is not None):
                write_path, write_children, write_weights = self._routes(phase_w, keys, writes=True)
            write_weights = write_weights if self.address is not None else None
        delta = increment[:, :, None, :].expand(B, T, L, M)
        positions = token_positions(position, T, doc_start, path.device)  # [T], or [B, T] per row
        starts = (positions % self.segment_len == 0) | (torch.arange(T, device=path.device) == 0)
        if doc_start is not None:
            starts = starts | doc_start
        segment = document_ids(starts.expand(B, T)) - 1  # the call's segments, numbered from 0 in each row
        by_segment = write_path + (segment * self.n_slots)[..., None]  # one slot id per (segment, slot)
        sequence = None
        if self.collision_scope == "sequence":
            sequence = SequenceCollisions(self.n_slots)
            sequence.add(delta, write_path, None if doc_start is None else document_ids(doc_start))
        elif self.collision_scope == "segment":
            delta = normalise_collisions(delta, by_segment)
        mixture = torch.is_grad_enabled() and self.learns_routes
        chosen = children == path[:, :, 1:, None]
        reset = self._resets(positions, doc_start, B)
        if phase_w is None:
            entries, entry_delta = self._entries(path, children, delta, mixture)
            read, memory = self._scan(entry_delta, entries, memory, reset, sp)
        else:
            read_entries, read_delta = self._entries(path, children, torch.zeros_like(delta), mixture)
            write_entries, write_delta = self._entries(write_path, write_children, delta, mixture, write_weights)
            entries, entry_delta = interleave(read_entries, write_entries), interleave(read_delta, write_delta)
            reset = None if reset is None else interleave(reset, torch.zeros_like(reset))
            read, memory = self._scan(entry_delta, entries, memory, reset, sp)
            read = read[:, 0::2]
        if mixture:  # the chosen child's read, picked by index (a boolean mask's size is read on the host)
            picked = chosen.long().argmax(-1)[..., None, None].expand(B, T, L - 1, 1, M)
            hard_read = torch.cat((read[:, :, :1], read[:, :, 1:].reshape(B, T, L - 1, N, M).gather(3, picked)
                                   .view(B, T, L - 1, M)), dim=2)
        else:
            hard_read = read
        features = self._demodulate(hard_read, phase_q)
        if mixture:
            every_child = self._demodulate(read[:, :, 1:], phase_q).view(B, T, L - 1, N, 2 * M)
            soft = torch.einsum("btln,btlnd->btld", weights, every_child)
            features = torch.cat((features[:, :, :1], straight_through_mixture(features[:, :, 1:], soft)), dim=2)
        with torch.no_grad():  # writes per slot, and the (row, segment) pairs in which each slot is written
            self.slot_writes = collision_counts(write_path, self.n_slots)[0].sum(0)
            _, first = key_counts(by_segment.reshape(B, -1))
            self.slot_segments = torch.zeros(self.n_slots, device=path.device).scatter_add_(
                0, write_path.reshape(-1), first.reshape(-1).float())
        return features, memory, sequence

    def _routes(
        self, phase: torch.Tensor, keys: torch.Tensor, writes: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`route` of the phasors of phase [B, T, M]: token by token for the reference, else at once;
        `writes` marks a write path of its own (`write_address: previous`), kept out of the diagnostics."""
        phasor = unit_phasor(phase)
        recording, self.record_routes = self.record_routes, self.record_routes and not writes
        try:
            if self.reference:
                routed = [self.route(phasor[:, t : t + 1], keys) for t in range(phase.shape[1])]
                return tuple(torch.cat(parts, dim=1) for parts in zip(*routed))
            return self.route(phasor, keys)
        finally:
            self.record_routes = recording

    def _entries(
        self, path: torch.Tensor, children: torch.Tensor, delta: torch.Tensor, mixture: bool,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scan's entries of each token [B, T, E] and their increments [B, T, E, M]: the path
        (E = L), or with the mixture the root, then every child of each node on the path, the chosen
        one carrying the write (E = 1 + (L-1) * N). With the children's softmax `weights` (a learned
        write address) each child's increment is the write times (chosen + w - w), exactly the write
        or zero in value, so the backward tells the address what writing to each child would do."""
        if not mixture:
            return path, delta
        B, T, L, M = delta.shape
        N = self.branching
        chosen = children == path[:, :, 1:, None]
        if weights is None:
            sibling_delta = torch.where(chosen[..., None], delta[:, :, 1:, None, :], 0.0)
        else:
            sibling_delta = delta[:, :, 1:, None, :] * straight_through_mixture(chosen.float(), weights)[..., None]
        sibling_delta = sibling_delta.reshape(B, T, (L - 1) * N, M)
        entries = torch.cat((path[:, :, :1], children.reshape(B, T, (L - 1) * N)), dim=2)
        return entries, torch.cat((delta[:, :, :1], sibling_delta), dim=2)

    def _resets(self, positions: torch.Tensor, doc_start: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """Where the phases go back to their initial values (bool [B, T], or None for nowhere): document
        starts, and with a horizon H every position within a document that is a multiple of H."""
        if not self.horizon:
            return doc_start
        horizon = (positions % self.horizon == 0).expand(batch, positions.shape[-1])
        return horizon if doc_start is None else horizon | doc_start

    def _scan(
        self, delta: torch.Tensor, slots: torch.Tensor, memory: torch.Tensor, reset: torch.Tensor | None,
        sp: SequenceParallel | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kernels.phasor_scan over the call, or token by token with the sequential reference, from the
        phases `memory` carried into the call; a sequence-parallel piece scans from zero and adds the
        earlier pieces' phases (kernels.phasor_scan_sequence_parallel; exact, since routing never reads
        the phases).

        With reset (bool [B, T]: document starts, horizon ends) the phases start again from their
        initial values, zero, not from `memory`: the kernel's reset forgets the carried phases.
        """
        if sp is not None:
            backend = "reference" if self.reference else self.scan_backend
            return phasor_scan_sequence_parallel(delta, slots, self.n_slots, sp.group, None, True, backend, reset)
        if self.reference:
            reads = []
            for t in range(delta.shape[1]):
                if reset is not None:
                    memory = torch.where(reset[:, t, None, None], 0.0, memory)
                read, memory = kernels.phasor_scan(delta[:, t : t + 1], slots[:, t : t + 1], self.n_slots,
                                                   initial_state=memory, output_final_state=True,
                                                   backend="reference")
                reads.append(read)
            return torch.cat(reads, dim=1), memory
        return kernels.phasor_scan(delta, slots, self.n_slots, initial_state=memory, output_final_state=True,
                                   backend=self.scan_backend, reset=reset)

    @staticmethod
    def _demodulate(read: torch.Tensor, phase_q: torch.Tensor) -> torch.Tensor:
        """Read phases [..., M] relative to the query: [cos(M - phi_q), sin(M - phi_q)]."""
        demod = read - phase_q[:, :, None, :]
        return torch.cat((demod.cos(), demod.sin()), dim=-1)
