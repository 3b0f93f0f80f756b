"""A training step as the GPU runs it, captured on the meta device, and its aten ops priced.

`capture_step_ops` builds the model of a config as benchmarks/launch_capture.py does (Triton scan backend,
bf16 weights as the engines' bf16 precision hands them to the layers, meta device) and runs one
training step under both benchmarks.predict.capture.capture_triton, which returns the scans' Triton launches
without running them (the launch model prices those), and `ops.recording`, which records every aten
op, those inside the scans' autograd Functions included:
- forward through `model.loss`, the trainer's loss path (model/interface.py's chunked cross-entropy
  once the tokens outgrow one chunk), with the blocks checkpointed as model/blocks.py does it in the
  ``activation_checkpointing`` mode (configs/base/pretrain.yaml turns it on), so the backward recomputes
  each block's forward but what the mode keeps (the scans' outputs; with "elementwise" the matmuls' too);
- backward;
- the optimizer step as DeepSpeed's bf16 ZeRO keeps it: the bf16 gradients cast into fp32 gradients,
  clipped by their global norm (torch's foreach clip_grad_norm_ sequence), fused AdamW over fp32 master
  weights and moments in pretrain/optim.py's parameter groups, and the master weights cast back into
  the bf16 model. Data-parallel collectives are not ops of one GPU and are left out.
Attention runs as CUDA's scaled_dot_product_attention picks it for bf16: flash attention without a
mask, memory-efficient attention with one (its boolean mask turned into an additive bias), the unfused
math path for operands that are not 4-d (as CUDA's dispatch does).

`price_ops` prices the ops one after another: GEMMs by benchmarks/predict/gemm.py (its FIXED_S is a
GEMM's per-call time), attention by its FLOPs at ATTENTION_EFFICIENCY of the bf16 peak, memory ops by
their bytes at ``memory_efficiency`` of the HBM bandwidth plus ``launch_overhead_s`` each, views free.
The Triton launches are not ops: the launch model prices them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.launch_capture import _meta_autocast, meta_model
from benchmarks.predict.capture import Launch, capture_triton
from benchmarks.predict.gemm import gemm_seconds
from benchmarks.predict.gpu import Gpu
from benchmarks.predict.ops import KINDS, Op, recording, summarize
from model.blocks import recomputes_matmuls
from model.config import ModelConfig
from pretrain.optim import param_groups

ATTENTION_EFFICIENCY = 0.35
"""Fraction of the bf16 peak torch's fused attention (FlashAttention-2's kernels) reaches on an H100:
"FlashAttention-2 achieving only 35% utilization on the H100 GPU" (Shah et al., "FlashAttention-3",
arXiv:2407.08608, abstract)."""

BETAS, EPS = (0.9, 0.95), 1e-8  # pretrain.config.TrainSection's defaults; they change no cost


@dataclasses.dataclass(frozen=True)
class StepCapture:
    """One training step's aten ops and Triton launches, and what its 6N check needs: the tokens, the
    matmul parameters, and the parameters of the blocks whose forward GEMMs the backward recomputes
    (blocks checkpointed in a mode that does not keep the matmuls' outputs; their vectors, norms and biases
    included, which run no GEMM)."""

    ops: list[Op]
    launches: list[Launch]
    tokens: int
    matmul_params: int
    recomputed_params: int

    @property
    def expected_gemm_flops(self) -> float:
        """6 x matmul parameters x tokens, plus 2 x recomputed parameters x tokens."""
        return float((6 * self.matmul_params + 2 * self.recomputed_params) * self.tokens)

    def summary(self) -> dict[str, Any]:
        """`ops.summarize` of the step's ops against its expected GEMM FLOPs, and the launch count."""
        return {**summarize(self.ops, self.expected_gemm_flops), "triton_launches": len(self.launches)}


_SDPA = F.scaled_dot_product_attention


def _fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     **kwargs: Any) -> torch.Tensor:
    """scaled_dot_product_attention through the op CUDA picks for bf16 operands: the fused kernels take
    only 4-d operands; others (model/attention_window.py's blocks) take the unfused math path there too."""
    if q.dim() != 4:
        return _SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    bias = attn_mask
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    bias = bias.expand(*q.shape[:-2], q.shape[-2], k.shape[-2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal,
                                                                  scale=scale)[0]


@contextlib.contextmanager
def _gpu_attention() -> Iterator[None]:
    """Route F.scaled_dot_product_attention to the fused ops for the block (meta tensors would take
    the unfused math path, which a GPU does not run)."""
    F.scaled_dot_product_attention = _fused_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA


def _optimizer_state(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Per parameter group of pretrain/optim.py: the bf16 parameters and fp32 masters, gradients,
    moments and step counts (allocated once, outside the step)."""
    groups = []
    for group in param_groups(model, weight_decay):
        params = group["params"]

        def fp32() -> list[torch.Tensor]:
            return [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in params]  # noqa: B023

        steps = [torch.zeros((), device=p.device) for p in params]
        groups.append({"params": params, "master": fp32(), "grads": fp32(), "exp_avg": fp32(), "exp_avg_sq": fp32(),
                       "steps": steps, "weight_decay": group["weight_decay"]})
    return groups


@torch.no_grad()
def _optimizer_step(groups: list[dict[str, Any]], grad_clip: float) -> None:
    """DeepSpeed bf16 ZeRO's step on one GPU, over the parameters that got a gradient: cast the
    gradients to fp32, clip by the global norm, fused AdamW on the fp32 masters, cast the masters back
    into the bf16 weights."""
    stepped = []  # per group, its lists for the parameters that got a gradient
    for g in groups:
        keep = [i for i, p in enumerate(g["params"]) if p.grad is not None]
        if keep:
            stepped.append({k: [v[i] for i in keep] if isinstance(v, list) else v for k, v in g.items()})
    for g in stepped:
        torch._foreach_copy_(g["grads"], [p.grad for p in g["params"]])
    grads = [t for g in stepped for t in g["grads"]]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.clamp(grad_clip / (total + 1e-6), max=1.0))
    for g in stepped:
        torch._foreach_add_(g["steps"], 1)
        torch._fused_adamw_(g["master"], g["grads"], g["exp_avg"], g["exp_avg_sq"], [], g["steps"], lr=1e-3,
                            beta1=BETAS[0], beta2=BETAS[1], weight_decay=g["weight_decay"], eps=EPS,
                            amsgrad=False, maximize=False)
        torch._foreach_copy_(g["params"], g["master"])


def capture_step_ops(
    cfg: ModelConfig, batch: int, tokens: int, activation_checkpointing: bool | str, target: int = 90,
    weight_decay: float = 0.1, grad_clip: float = 1.0,
) -> StepCapture:
    """The aten ops and Triton launches of one training step of ``cfg`` on ``batch`` x ``tokens`` tokens
    per GPU, for a GPU of compute capability ``target`` (weight_decay and grad_clip as
    configs/base/pretrain.yaml sets them; they change no cost)."""
    if batch <= 0 or tokens <= 0:
        raise ValueError(f"batch and tokens must be positive, got {batch} x {tokens}")
    model = meta_model(cfg)
    model.train()
    model.activation_checkpointing = activation_checkpointing
    groups = _optimizer_state(model, weight_decay)
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    with capture_triton(target) as launches, _meta_autocast(), _gpu_attention(), recording() as ops:
        loss, _state = model.loss(ids, ids)
        loss.backward()
        _optimizer_step(groups, grad_clip)
    blocks = sum(p.numel() for p in model.blocks.parameters()) if recomputes_matmuls(activation_checkpointing) else 0
    return StepCapture(list(ops), list(launches), batch * tokens, model.matmul_params(), blocks)


def price_by_kind(ops: list[Op], gpu: Gpu, memory_efficiency: float, launch_overhead_s: float) -> dict[str, float]:
    """Predicted seconds of ``ops`` on ``gpu``, per kind (see the module's docstring)."""
    if not 0 < memory_efficiency <= 1 or launch_overhead_s < 0:
        raise ValueError(f"memory_efficiency must be in (0, 1] and launch_overhead_s >= 0, got "
                         f"{memory_efficiency}, {launch_overhead_s}")
    seconds = dict.fromkeys(KINDS, 0.0)
    for op in ops:
        if op.kind == "gemm":
            d = op.gemm
            seconds["gemm"] += gemm_seconds(d.batch, d.m, d.n, d.k, d.dtype, gpu)
        elif op.kind == "attention":
            seconds["attention"] += op.flops / (gpu.bf16_peak * ATTENTION_EFFICIENCY)
        elif op.kind == "memory":
            seconds["memory"] += op.bytes / (gpu.hbm_bytes_per_s * memory_efficiency) + launch_overhead_s
    return seconds


def price_ops(ops: list[Op], gpu: Gpu, memory_efficiency: float, launch_overhead_s: float) -> float:
    """Predicted seconds of ``ops`` run one after another on ``gpu``."""
    return sum(price_by_kind(ops, gpu, memory_efficiency, launch_overhead_s).values())
