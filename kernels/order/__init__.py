"""Per-token mixing coefficients of a bank of kernels, chosen by an order that a distribution's entropy and
a gate set, as one op: VORT's order router after its probes (model/vort_memory.py).

    H = -sum_j p_j log p_j / log P          p = softmax(logits), P classes
    alpha_h = delta + (1 - delta) sigmoid(bias_h + g_h (1 - H) + c_h (2 gate - 1))    per head h
    coef_h = the bank table's rows interpolated linearly at alpha_h (clamped to the banks' range)

Two paths, one meaning:
- "torch" (the CPU path, and the only one for banks or a table that need a gradient, or a single bank):
  composite aten ops in the work dtype, differentiated by autograd;
- "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1): the forward kernel reads a row's logits once and
  writes its coefficients, orders and entropy; the backward kernel recomputes them and writes the gradients
  of the logits, the gate and (as per-program shares, summed in order) the per-head parameters
  (kernels/order/triton.py). Composite, this is some forty small kernels forward and as many backward a
  layer, on [tokens, heads] and [tokens, heads, terms] tensors.
The orders and the entropy are returned for statistics and take no gradient.

The Triton path is the op ``recurrent::order_coefficients`` (kernels/library.py's namespace) with its backward
op, so that torch.compile keeps it in its graph; on meta tensors the ops run the kernels' launches as a device
does, for benchmarks/launch_capture.py and the step model to capture them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kernels._common import resolve_backend, work_dtype
from kernels.library import fused_op


def interpolate_coefficients(alpha: Tensor, banks: Tensor, coef: Tensor) -> Tensor:
    """Per-token coefficients by linear interpolation between the two neighbouring banks.

    alpha: [...] orders (clamped to [banks[0], banks[-1]]); banks: [K] increasing; coef: [K, S].
    Returns [..., S]. Differentiable in alpha (piecewise linear) and in coef; the interpolated kernel is the
    same linear blend of the two bank kernels, which is what model.soe's ``bank_layout_error`` measures.
    """
    a = alpha.clamp(banks[0], banks[-1])
    if banks.numel() == 1:
        return coef[0].expand(*a.shape, coef.shape[-1])
    idx = torch.searchsorted(banks, a.detach().contiguous(), right=True).clamp(1, banks.numel() - 1)
    left, right = banks[idx - 1], banks[idx]
    theta = ((a - left) / (right - left)).unsqueeze(-1)
    return coef[idx - 1] * (1.0 - theta) + coef[idx] * theta


def order_coefficients(logits: Tensor, gate: Tensor, bias: Tensor, entropy_gain: Tensor, gate_gain: Tensor,
                       banks: Tensor, table: Tensor, delta: float,
                       backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """(coef [..., H, S], alpha [..., H], normalised entropy [...]) for logits [..., P], a gate [...] in (0, 1),
    per-head ``bias``, ``entropy_gain`` and ``gate_gain`` [H], increasing ``banks`` [K] and a ``table`` [K, S]
    of coefficients; in the work dtype (fp32 for 16-bit logits). ``backend``: "reference" or "torch"
    (composite ops), "triton" or "auto" (Triton for CUDA tensors)."""
    heads = bias.shape[0]
    if gate.shape != logits.shape[:-1] or entropy_gain.shape != (heads,) or gate_gain.shape != (heads,):
        raise ValueError(f"order_coefficients: logits {tuple(logits.shape)}, gate {tuple(gate.shape)}, bias, "
                         f"entropy_gain, gate_gain {tuple(bias.shape)}, {tuple(entropy_gain.shape)}, "
                         f"{tuple(gate_gain.shape)}: expected the gate [...] of logits [..., P] and [H] each")
    if banks.dim() != 1 or table.shape[0] != banks.shape[0]:
        raise ValueError(f"order_coefficients: banks {tuple(banks.shape)} and table {tuple(table.shape)}: "
                         f"expected [K] and [K, S]")
    fixed = not (banks.requires_grad or table.requires_grad) and banks.shape[0] > 1
    if not fixed or resolve_backend(backend, logits) in ("reference", "torch"):
        return order_coefficients_torch(logits, gate, bias, entropy_gain, gate_gain, banks, table, delta)
    return order_coefficients_op(logits, gate, bias, entropy_gain, gate_gain, banks, table, float(delta))


def orders(logits: Tensor, gate: Tensor, bias: Tensor, entropy_gain: Tensor, gate_gain: Tensor,
           delta: float) -> tuple[Tensor, Tensor]:
    """(alpha [..., H], normalised entropy [...]) as composite ops in the work dtype: the orders alone."""
    dt = work_dtype(logits.dtype)
    logp = torch.log_softmax(logits.to(dt), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1) / math.log(logp.shape[-1])
    logit = (bias.to(dt) + entropy_gain.to(dt) * (1.0 - entropy)[..., None]
             + gate_gain.to(dt) * (2.0 * gate - 1.0)[..., None])
    return delta + (1.0 - delta) * torch.sigmoid(logit), entropy


def order_coefficients_torch(logits: Tensor, gate: Tensor, bias: Tensor, entropy_gain: Tensor, gate_gain: Tensor,
                             banks: Tensor, table: Tensor, delta: float) -> tuple[Tensor, Tensor, Tensor]:
    """The composite form (the reference the kernels are tested against)."""
    alpha, entropy = orders(logits, gate, bias, entropy_gain, gate_gain, delta)
    return interpolate_coefficients(alpha, banks.to(alpha.dtype), table.to(alpha.dtype)), alpha, entropy


def _forward(logits: Tensor, gate: Tensor, bias: Tensor, entropy_gain: Tensor, gate_gain: Tensor, banks: Tensor,
             table: Tensor, delta: float) -> tuple[Tensor, Tensor, Tensor]:
    from kernels.order.triton import forward

    return forward(logits, gate, bias, entropy_gain, gate_gain, banks, table, delta)


def _backward(logits: Tensor, gate: Tensor, bias: Tensor, entropy_gain: Tensor, gate_gain: Tensor, banks: Tensor,
              table: Tensor, delta: float, d_coef: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from kernels.order.triton import backward

    return backward(logits, gate, bias, entropy_gain, gate_gain, banks, table, delta, d_coef)


def _outputs(logits: Tensor, gate: Tensor, bias: Tensor, entropy_gain: Tensor, gate_gain: Tensor, banks: Tensor,
             table: Tensor, delta: float) -> tuple[Tensor, Tensor, Tensor]:
    lead = logits.shape[:-1]
    make = lambda *shape: logits.new_empty(*shape, dtype=torch.float32)  # noqa: E731
    return make(*lead, bias.shape[0], table.shape[1]), make(*lead, bias.shape[0]), make(*lead)


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    *tensors, ctx.delta = inputs
    ctx.save_for_backward(*tensors)
    ctx.mark_non_differentiable(output[1], output[2])


def _gradients(ctx, backward_op: Any, d_coef: Tensor, _d_alpha: Tensor | None, _d_entropy: Tensor | None) -> tuple:
    return (*backward_op(*ctx.saved_tensors, ctx.delta, d_coef), None, None, None)


_INPUTS = "Tensor logits, Tensor gate, Tensor bias, Tensor entropy_gain, Tensor gate_gain, Tensor banks, Tensor table"
order_coefficients_op = fused_op(
    "order_coefficients", _forward, f"({_INPUTS}, float delta) -> (Tensor, Tensor, Tensor)", _outputs,
    _backward, f"({_INPUTS}, float delta, Tensor d_coef) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    lambda logits, gate, bias, eg, gg, banks, table, delta, d_coef: tuple(
        torch.empty_like(t, memory_format=torch.contiguous_format) for t in (logits, gate, bias, eg, gg)),
    _setup, _gradients)
