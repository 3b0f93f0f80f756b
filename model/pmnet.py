"""PMNet: byte-level LM with sliding-window attention and a hierarchical unit-phasor memory.

A block is pre-norm sliding-window attention, then (in the blocks `memory_every` selects) the
phasor memory of model/pmnet_memory.py, then a SwiGLU MLP. The streaming state of a block is its
position, the last window-1 keys/values and the memory phases, so a long byte stream processed
piecewise gives the outputs it gives processed whole, in memory that does not grow with its length.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from model.attention_window import SlidingWindowAttention
from model.blocks import Offset, RMSNorm, StackedLM, SwiGLU, call_offset, next_offset, short_convolution
from model.config import ModelConfig, PMNetConfig
from model.interface import ScanShape, SequenceParallel
from model.pmnet_memory import MemoryState, PhasorMemory


def usage_entropy(counts: torch.Tensor) -> float:
    """Entropy of the distribution counts / sum over its maximum log(len): 1 uniform, 0 one slot."""
    p = counts / counts.sum()
    return float(-(p * p.clamp_min(1e-12).log()).sum() / math.log(len(counts)))


class PMNetBlockState(NamedTuple):
    """What one block carries between calls (keys/values None before the first token; conv, the
    short convolution's last inputs, None without one). position: the next token's, within its
    document under doc_start (long [B])."""

    position: Offset
    keys: torch.Tensor | None
    values: torch.Tensor | None
    memory: MemoryState | None
    conv: torch.Tensor | None = None


def has_memory(layer: int, config: PMNetConfig) -> bool:
    """Memory in every `memory_every`-th block, the last block of each group; none when 0."""
    return config.memory_every > 0 and (layer + 1) % config.memory_every == 0


class PMNetBlock(nn.Module):
    """Pre-norm residual block: (short convolution,) sliding-window attention, optional phasor
    memory, SwiGLU MLP."""

    def __init__(self, config: ModelConfig, with_memory: bool):
        super().__init__()
        pm = config.pmnet
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.short_conv = short_convolution(config)
        self.attn = SlidingWindowAttention(config.d_model, config.n_heads, pm.window, config.rope_base)
        own_norm = with_memory and pm.memory_input == "residual"
        self.memory_norm = RMSNorm(config.d_model, config.norm_eps) if own_norm else None
        self.memory = PhasorMemory(config.d_model, pm) if with_memory else None
        self.route_input = pm.route_input
        # `route_input: embedding`: the token embedding, normed for the router as the block's input is
        embedded = with_memory and pm.route_input == "embedding"
        self.route_norm = RMSNorm(config.d_model, config.norm_eps) if embedded else None
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.mlp_ratio)

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> PMNetBlockState:
        memory = self.memory.init_state(batch_size, device) if self.memory is not None else None
        conv = self.short_conv.init_state(batch_size, device) if self.short_conv is not None else None
        return PMNetBlockState(0, None, None, memory, conv)

    def forward(
        self,
        x: torch.Tensor,
        state: PMNetBlockState | None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
        embedded: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PMNetBlockState]:
        """One block on x [B, T, d]; ``embedded`` [B, T, d], the token embeddings, routes the memory
        under `route_input: embedding` (PMNet.block_inputs passes it)."""
        sp = sequence_parallel
        if state is None:
            state = self.init_state(x.shape[0], x.device)
        offset = call_offset(state.position, sp)
        normed = self.attn_norm(x)
        h, conv = normed, None
        if self.short_conv is not None:
            h, conv = self.short_conv(normed, state.conv, sp, doc_start, offset)
        attended, keys, values = self.attn(h, state.keys, state.values, offset, sp, doc_start)
        x = x + attended
        memory = state.memory
        if self.memory is not None:
            memory_in = self.memory_norm(x) if self.memory_norm is not None else h  # h: what attention saw
            # the addresses: `pre_conv` the block's normed input, which the convolution has not mixed with
            # its neighbours; `embedding` the token itself, which neither convolution nor attention has
            # mixed (a key routes alike at its pair and at its query in every block); `memory` memory_in
            route_in = {"pre_conv": normed, "memory": memory_in}.get(self.route_input)
            if route_in is None:
                if embedded is None:
                    raise ValueError("route_input 'embedding' needs the token embeddings (PMNet.block_inputs)")
                route_in = self.route_norm(embedded)
            read, memory = self.memory(memory_in, memory, offset, sp, doc_start, address_input=h, route_input=route_in)
            x = x + read
        x = x + self.mlp(self.mlp_norm(x))
        return x, PMNetBlockState(next_offset(offset, x.shape[1], doc_start), keys, values, memory, conv)


class PMNet(StackedLM):
    """The PMNet language model (kind "pmnet"); `memory_every = 0` is the SWA-only ablation."""

    supports_sequence_parallel = True

    @classmethod
    def sequence_parallel_problem(cls, config: ModelConfig, piece: int) -> str | None:
        pm = config.pmnet
        if piece < pm.window - 1:
            return (f"a piece of data.seq_len/sequence_parallel={piece} tokens is shorter than the attention halo "
                    f"model.pmnet.window-1={pm.window - 1}: use fewer ranks per sequence or a longer seq_len")
        if pm.memory_every and piece % pm.segment_len:
            return (f"a piece of data.seq_len/sequence_parallel={piece} tokens must be whole memory segments of "
                    f"model.pmnet.segment_len={pm.segment_len}")
        return None

    @classmethod
    def doc_boundaries_problem(cls, config: ModelConfig, sequence_parallel: int) -> str | None:
        pm = config.pmnet
        if sequence_parallel > 1 and pm.memory_every and pm.collision_scope == "segment":
            return ("model.pmnet.collision_scope=segment is not supported with sequence parallelism (a document's "
                    "segments cross the pieces' borders); use collision_scope: sequence")
        return None

    @classmethod
    def scan_shape(cls, config: ModelConfig) -> ScanShape | None:
        """The phasor scan of the memory blocks (None for the SWA-only ablation, which has none)."""
        pm = config.pmnet
        return ScanShape("phasor", (pm.depth + 1, pm.memory_dim, pm.n_slots)) if pm.memory_every else None

    def state_bytes(self, batch: int, sequence_parallel: int) -> tuple[float, float]:
        """fp32 phases and segment phases per memory block; under sequence parallelism the attention
        halo (received and sent, every layer) and per memory block the N gathered local phases and the
        entering ones (kernels.phasor_scan_sequence_parallel)."""
        c, pm = self.config, self.config.pmnet
        phases = len(self.memories()) * batch * pm.n_slots * pm.memory_dim * 4
        memory = phases * 2
        if sequence_parallel == 1:
            return memory, 0.0
        halo = c.n_layers * 2 * batch * (pm.window - 1) * c.d_model * 4 * 2
        return memory, halo + phases * (sequence_parallel + 1)

    def __init__(self, config: ModelConfig):
        super().__init__(config, lambda i: PMNetBlock(config, has_memory(i, config.pmnet)))
        for memory in self.memories():  # after StackedLM's generic init: the memory starts as a no-op
            memory.init_weights()

    def block_inputs(self, embedded: torch.Tensor, first_state: Any, sequence_parallel: SequenceParallel | None,
                     doc_start: torch.Tensor | None) -> dict[str, Any]:
        """Under `route_input: embedding` every block gets the token embeddings, which route its memory."""
        return {"embedded": embedded} if self.config.pmnet.route_input == "embedding" else {}

    def auxiliary_loss(self) -> torch.Tensor | None:
        """In training with `pmnet.balance_loss` > 0: that weight times the memory blocks' mean
        load-balancing loss of the last forward (PhasorMemory.balance_loss; under sequence
        parallelism each block's is the whole sequence's)."""
        weight = self.config.pmnet.balance_loss
        if not (self.training and weight > 0 and self.memories()):
            return None
        return weight * torch.stack([m.balance for m in self.memories()]).mean()

    def no_weight_decay(self) -> set[str]:
        """With `pmnet.decay_routing` false: the anchors and write projections of every memory."""
        if self.config.pmnet.decay_routing:
            return set()
        return {f"{prefix}.{name}" for prefix, module in self.named_modules() if isinstance(module, PhasorMemory)
                for name in module.routing_parameters()}

    def memories(self) -> list[PhasorMemory]:
        return [b.memory for b in self.blocks if b.memory is not None]

    def memory_parameters(self) -> int:
        return sum(p.numel() for memory in self.memories() for p in memory.parameters())

    def record_routes(self, on: bool = True) -> None:
        """Keep every routing decision of each forward (a diagnostic: experiments.sp_divergence)."""
        for memory in self.memories():
            memory.record_routes, memory.recorded = on, []

    def take_routes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded decisions of the last forward and clear them: slots [layers, B, T, levels] and
        the best child's score minus the runner-up's [layers, B, T, levels - 1]. With activation
        checkpointing the backward routes every token again; only the forward's decisions are kept."""
        passes = 2 if self.activation_checkpointing else 1
        slots, margins = [], []
        for memory in self.memories():
            kept = memory.recorded[: len(memory.recorded) // passes]
            slots.append(torch.cat([r[0] for r in kept], dim=1))
            margins.append(torch.cat([r[1] for r in kept], dim=1))
            memory.recorded = []
        return torch.stack(slots), torch.stack(margins)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul parameter, windowed attention, the memory's own work.

        Attention counts the useful work only (QK^T and AV over the mean number of keys a query
        sees, min(t+1, window) averaged over the sequence), not the masked half of each block.
        Memory per token and level: routing scores over `branching` children (2 * 2M each), the
        demodulated read (cos/sin counted as one op each) and the write; x3 for forward+backward.
        """
        c, pm = self.config, self.config.pmnet
        W = min(pm.window, seq_len)
        mean_keys = (W * (W + 1) / 2 + (seq_len - W) * W) / seq_len
        attention = 3 * 2 * 2 * c.n_layers * c.d_model * mean_keys
        memories = self.memories()
        anchors = sum(m.anchors.numel() for m in memories if isinstance(m.anchors, nn.Parameter))
        M, L = pm.memory_dim, pm.depth + 1
        per_memory = 2 * pm.depth * pm.branching * 2 * M + L * (4 * M) + L * M
        if pm.routing == "hash":  # the fixed routing projection, a matmul without parameters (forward only)
            per_memory += 2 * c.d_model * M / 3
        if pm.routing == "learned" and pm.route_input != "memory":  # the query applied to the route input too
            per_memory += 2 * c.d_model * M
        if pm.write_address != "current":  # the write path's own routing scores
            per_memory += 2 * pm.depth * pm.branching * 2 * M / 3
        return 6.0 * (self.matmul_params() - anchors) + attention + 3 * len(memories) * per_memory

    def stats(self) -> dict[str, Any]:
        """Observability of the last forward/backward, over all memory blocks.

        slot_usage: per slot, the share of tokens whose path visits it (the root is 1, each level
        sums to 1); collisions: per slot, the mean number of writers in a segment that wrote it;
        leaf_entropy: entropy of leaf usage over its maximum (1 = uniform, near 0 = collapse);
        level<l>/entropy and level<l>/slots_used: per routed level l, the entropy of the use of its
        slots over its maximum and the share of its slots written at all, each per memory block and
        averaged over the blocks (a block that collapses shows even when others do not);
        balance_loss: the memory blocks' mean load-balancing loss of the last training forward,
        before its weight (the training loss holds it times `pmnet.balance_loss`);
        memory_write_grad_norm: the norm of the gradient that reached the memory writes
        (recorded by a hook on the write increments during backward — the paper's "memory wakes
        up" spike shows here).
        """
        memories = self.memories()
        if not memories:
            return {}
        writes = sum(m.slot_writes.cpu() for m in memories)
        segments = sum(m.slot_segments.cpu() for m in memories)
        out: dict[str, Any] = {
            "pmnet/slot_usage": writes / writes.sum().clamp_min(1.0) * memories[0].n_levels,
            "pmnet/collisions": writes / segments.clamp_min(1.0),
        }
        leaves = writes[-memories[0].branching ** memories[0].depth :]
        if leaves.sum() > 0:
            out["pmnet/leaf_entropy"] = usage_entropy(leaves)
        for level in range(1, memories[0].n_levels):
            start, width = int(memories[0].level_offsets[level]), memories[0].branching**level
            used = [m.slot_writes[start : start + width].cpu() for m in memories]
            used = [u for u in used if u.sum() > 0]
            if used:
                out[f"pmnet/level{level}/entropy"] = sum(usage_entropy(u) for u in used) / len(used)
                out[f"pmnet/level{level}/slots_used"] = sum(float((u > 0).float().mean()) for u in used) / len(used)
        balances = [m.balance.detach() for m in memories if m.balance is not None]
        if balances:  # unweighted: 1 at even use, up to the number of a level's slots at collapse
            out["pmnet/balance_loss"] = float(torch.stack(balances).mean())
        grads = [m.last_write_grad_sq for m in memories if m.last_write_grad_sq is not None]
        if grads:
            out["pmnet/memory_write_grad_norm"] = float(torch.stack(grads).sum().sqrt())
        return out
