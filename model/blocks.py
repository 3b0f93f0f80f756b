"""Building blocks shared by every family: norm, MLP, rotary embedding, and the layer stack."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kernels import document_numbers
from kernels._common import scans_as_ops
from kernels.features import rotate
from kernels.library import SCAN_OPS
from kernels.norm import rms_norm
from kernels.parallel import exchange_with_neighbours
from kernels.swiglu import swiglu
from model.config import ModelConfig
from model.interface import CausalLM, LMHead, LMOutput, SequenceParallel


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 whatever the input dtype (kernels.rms_norm)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.backend = "auto"  # kernels.rms_norm's: one fused Triton op for CUDA tensors, composite ops on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.backend)


class SwiGLU(nn.Module):
    """Gated MLP; the hidden width is rounded to a multiple of 64 for matmul-friendly shapes."""

    def __init__(self, dim: int, ratio: float):
        super().__init__()
        hidden = max(64, round(dim * ratio * 2 / 3 / 64) * 64)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.backend = "auto"  # kernels.swiglu's: one fused Triton op for CUDA tensors, composite ops on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x), self.backend))


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over time: y_t = sum_j w[c, j] x_{t-K+1+j} per channel c.

    Every family can put one before its sequence mixer (`model.short_conv: K`). It hands the mixer
    each token mixed with the K-1 before it, which is the previous-token step of an induction head
    (match the token after an earlier copy of the current one) for free, the reason Zoology's
    attention baseline, Mamba, GLA and flash-linear-attention's `ShortConvolution` carry one. The
    state is the last K-1 inputs: a call continues from the previous call's tail, and a
    sequence-parallel piece receives the previous rank's tail (a halo, as the sliding-window
    attention's keys) and sends that tail's gradient back.
    """

    def __init__(self, dim: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, bias=False)

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The last K-1 inputs before the first token: zeros [B, K-1, dim]."""
        return torch.zeros(batch_size, self.kernel - 1, self.conv.in_channels, device=device)

    def forward(
        self,
        x: torch.Tensor,
        tail: torch.Tensor | None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
        offset: Offset = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, dim] after the inputs in `tail` [B, K-1, dim] (zeros when None) -> (y [B, T, dim],
        the new tail). With ``sequence_parallel`` the tail comes from the previous rank instead. With
        ``doc_start`` (bool [B, T]) a token mixes only inputs of its own document; ``offset``, the first
        token's position within its document, says how many of the tail's inputs are in that document."""
        n = self.kernel - 1
        if sequence_parallel is not None and n > 0:
            if x.shape[1] < n:
                raise ValueError(f"a sequence-parallel piece of {x.shape[1]} tokens is shorter than the halo of {n}")
            own, tail = exchange_with_neighbours(x[:, -n:], sequence_parallel.group)
            x = torch.cat((x[:, :-n], own), dim=1)
        if tail is None:
            tail = x.new_zeros(x.shape[0], n, x.shape[2])
        padded = torch.cat((tail.to(x.dtype), x), dim=1)
        if doc_start is None:
            y = self.conv(padded.transpose(1, 2)).transpose(1, 2)
        else:  # each tap weighted by whether its input is in the token's document
            ids = prefix_document_ids(doc_start, offset, n)  # [B, K-1 + T]
            same = (ids.unfold(1, self.kernel, 1) == ids[:, n:, None]).to(x.dtype)  # [B, T, K]
            y = torch.einsum("btck,ck,btk->btc", padded.unfold(1, self.kernel, 1), self.conv.weight[:, 0], same)
        return y, padded[:, padded.shape[1] - n :]


def short_convolution(config: ModelConfig) -> ShortConvolution | None:
    """The block's short convolution when `config.short_conv` > 0, else None."""
    return ShortConvolution(config.d_model, config.short_conv) if config.short_conv > 0 else None


def document_ids(doc_start: torch.Tensor) -> torch.Tensor:
    """Document number [B, T] (int64) of each token: kernels' `document_numbers` of the document starts
    (bool [B, T]). Two tokens of a row are in the same document exactly when their numbers are equal."""
    return document_numbers(doc_start, *doc_start.shape, doc_start.device, torch.long)


Offset = int | torch.Tensor
"""Position of a call's first token: one int for every row, or per row (long [B]) once documents restart
positions (then it is the position within the row's current document)."""


def token_positions(offset: Offset, length: int, doc_start: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Positions of `length` tokens whose first is at `offset`: [T] offset.. (or [B, T] for per-row
    offsets), or with ``doc_start`` (bool [B, T]) [B, T] counted from each token's document start (tokens
    before a row's first start continue from ``offset``), so a packed document has the positions it has
    alone."""
    index = torch.arange(length, device=device)
    base = offset if isinstance(offset, int) else offset.to(device)[:, None]
    if doc_start is None:
        return base + index
    last_start = torch.where(doc_start, index, -1).cummax(dim=1).values
    return torch.where(last_start >= 0, index - last_start, base + index)


def call_offset(carried: Offset | None, sequence_parallel: SequenceParallel | None) -> Offset:
    """Position of a call's first token: the sequence-parallel piece's, else the carried state's (0 without)."""
    if sequence_parallel is not None:
        return sequence_parallel.offset
    return 0 if carried is None else carried


def next_offset(offset: Offset, length: int, doc_start: torch.Tensor | None) -> Offset:
    """The offset of the call that follows a call of `length` tokens at `offset`: offset + length, or
    with ``doc_start`` the position after each row's last token within its document (long [B])."""
    if doc_start is None:
        return offset + length
    return token_positions(offset, length, doc_start, doc_start.device)[:, -1] + 1


def prefix_document_ids(doc_start: torch.Tensor, offset: Offset, n_prefix: int) -> torch.Tensor:
    """Document numbers [B, n_prefix + T] of the `n_prefix` tokens before a call (a key cache, an
    attention halo, a convolution's tail) followed by the call's own (`document_ids`). An earlier token
    at distance d before the first is in the first token's document, number 0, when d <= offset (the
    first token's position within its document), and in another one, -1, which matches nothing."""
    distance = torch.arange(n_prefix, 0, -1, device=doc_start.device)
    reach = torch.as_tensor(offset, device=doc_start.device).reshape(-1, 1)
    prefix = torch.where(distance <= reach, 0, -1).expand(doc_start.shape[0], n_prefix)
    return torch.cat((prefix, document_ids(doc_start)), dim=1)


def documents_across_pieces(doc_start: torch.Tensor, sp: SequenceParallel) -> SequenceParallel:
    """`sp` for a sequence-parallel piece whose tokens start documents where doc_start (bool [B, T]) is
    True: ``offset`` becomes each row's first-token position within its document (long [B]: its global
    index minus the global index of its document's start, which may lie on an earlier rank). One
    all-gather of one number per row, each piece's last start; nothing is read on the host."""
    index = torch.arange(doc_start.shape[1], device=doc_start.device)
    last_start = torch.where(doc_start, sp.offset + index, -1).max(dim=1).values  # [B], -1: none in the piece
    every = [torch.empty_like(last_start) for _ in range(sp.size)]
    dist.all_gather(every, last_start.contiguous(), group=sp.group)
    entering_start = torch.stack([torch.full_like(last_start, -1), *every[: sp.rank]]).max(dim=0).values
    offset = torch.where(entering_start >= 0, sp.offset - entering_start, sp.offset)
    return dataclasses.replace(sp, offset=offset)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
) -> torch.Tensor:
    """torch's fused scaled-dot-product attention, with half-precision CPU operands computed in fp32
    and cast back: torch's CPU bf16/fp16 kernel needs AVX-512 (it raises "pack_vnni2 is only
    supported when avx512 is supported" under ATEN_CPU_CAPABILITY avx2 or default), and the fp32
    path gives the same result on every CPU. GPUs keep the operands' dtype."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask, is_causal=is_causal)
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., T, head_dim/2] for absolute positions [T] or per-row positions [B, T]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, T, H, D] by the position angles ([T, D/2]
    shared by the rows, or [B, T, D/2]), in fp32, returned in x's dtype (kernels.features.rotate)."""
    return rotate(x.float(), cos, sin).to(x.dtype)


def _keep_scan_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective activation checkpointing's policy: keep what each scan returns, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SCAN_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                      torch.ops.aten.baddbmm.default})


def _keep_scan_and_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The "elementwise" policy: keep what each scan and each matmul returns; the backward recomputes only
    the elementwise work between them (norms, activations, rotary, feature maps), which moves bytes but
    runs no FLOP worth a tensor core."""
    keep = op in SCAN_OPS or op in _MATMULS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


CHECKPOINT_POLICIES: dict[bool | str, Callable[[], Any]] = {
    True: functools.partial(create_selective_checkpoint_contexts, _keep_scan_outputs),
    "elementwise": functools.partial(create_selective_checkpoint_contexts, _keep_scan_and_matmul_outputs),
}
"""The checkpointed blocks' ``context_fn`` per ``activation_checkpointing`` mode. True: the backward
recomputes a block's forward except its scans, whose outputs the forward kept (the scans' kernels are the
dearest part of a block to run again, and their outputs, about one activation per block, are small beside
what the whole forward keeps). "elementwise": the matmuls' outputs are kept too (a few activations per
block more: the projections' and the MLP's outputs), so the recompute runs no GEMM."""


def recomputes_matmuls(mode: bool | str) -> bool:
    """Whether the backward of blocks checkpointed in ``mode`` runs their matmuls again (False: none)."""
    return bool(mode) and mode != "elementwise"


def checkpoint_policy(mode: bool | str) -> Callable[[], Any]:
    """The ``context_fn`` of activation checkpointing ``mode`` (True or "elementwise")."""
    if mode not in CHECKPOINT_POLICIES:
        raise ValueError(f"activation_checkpointing: expected false, true or 'elementwise', got {mode!r}")
    return CHECKPOINT_POLICIES[mode]


def _scans_through_ops(block: nn.Module) -> Callable[..., Any]:
    """``block`` with its scans called as custom ops in eager mode (compiled code calls them so anyway),
    so that selective checkpointing sees each scan as one op (kernels._common.scans_as_ops)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with scans_as_ops():
            return block(*args, **kwargs)

    return run


class StackedLM(CausalLM):
    """Token embedding, a stack of residual blocks, final norm and LM head.

    Each block is called as `block(x, state, sequence_parallel, doc_start) -> (x, state)`; the
    stack's state is the list of the blocks' states, so a family only has to say what one block
    carries. With ``doc_start`` (bool [B, T], True where a token starts a document) every block keeps
    each document to itself, as if it were run alone: also when a carried state or the earlier pieces
    of a sequence-parallel group hold the start of the first tokens' document, whose positions then
    continue (the states carry positions within the current document).
    """

    def __init__(self, config: ModelConfig, make_block: Callable[[int], nn.Module]):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(make_block(i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = LMHead(config.d_model, config.vocab_size)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.activation_checkpointing: bool | str = False  # the trainer's mode: False, True or "elementwise"
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> list[Any]:
        return [getattr(b, "init_state", lambda *_: None)(batch_size, device) for b in self.blocks]

    def forward(
        self,
        input_ids: torch.Tensor,
        state: list[Any] | None = None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
    ) -> LMOutput:
        hidden, new_states = self.hidden_states(input_ids, state, sequence_parallel, doc_start)
        return LMOutput(self.head(hidden), new_states)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        state: list[Any] | None = None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[Any]]:
        if doc_start is not None and (doc_start.shape != input_ids.shape or doc_start.dtype != torch.bool):
            raise ValueError(f"doc_start must be bool {tuple(input_ids.shape)}, got {doc_start.dtype} "
                             f"{tuple(doc_start.shape)}")
        if sequence_parallel is not None:
            if not self.supports_sequence_parallel:
                raise ValueError(f"model kind {self.config.kind!r} does not run sequence-parallel")
            if state is not None:
                raise ValueError("a sequence-parallel piece takes no carried state (it comes from the other ranks)")
            if doc_start is not None:
                sequence_parallel = documents_across_pieces(doc_start, sequence_parallel)
        x = self.embed(input_ids)
        states = state if state is not None else [None] * len(self.blocks)
        extra = self.block_inputs(x, states[0], sequence_parallel, doc_start)
        new_states = []
        for block, block_state in zip(self.blocks, states, strict=True):
            if self.activation_checkpointing and self.training:
                run = block if torch.compiler.is_compiling() else _scans_through_ops(block)
                x, block_state = checkpoint(run, x, block_state, sequence_parallel, doc_start, use_reentrant=False,
                                            context_fn=checkpoint_policy(self.activation_checkpointing), **extra)
            else:
                x, block_state = block(x, block_state, sequence_parallel, doc_start, **extra)
            new_states.append(block_state)
        return self.norm(x), new_states

    def block_inputs(self, embedded: torch.Tensor, first_state: Any, sequence_parallel: SequenceParallel | None,
                     doc_start: torch.Tensor | None) -> dict[str, Any]:
        """Keyword inputs every block gets besides the residual stream, made once a call: from the token
        embeddings [B, T, d], the first block's carried state (None without), the sequence-parallel piece and
        the document starts. None here; a family whose blocks read the tokens themselves, or share a table
        that depends only on positions, names them."""
        return {}

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the embedding lookup does not)."""
        total = sum(p.numel() for p in self.blocks.parameters()) + self.head.weight.numel()
        return total
