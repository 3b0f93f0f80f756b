"""Triton kernels of the fused order coefficients (kernels/order/__init__.py has the op and its math): one
program per BN rows (SHAPES). The forward reads a row's logits once, makes its entropy, every head's order and the
order's interpolated coefficients; the backward recomputes those from the same inputs, writes the logits' and
the gate's gradients and each program's share of the per-head parameters' gradients, which the op sums over
the programs in order (no atomics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import Launch, triton_type

SHAPES = {"forward": (1, 2), "backward": (1, 2)}
"""(rows per program, warps) of each kernel: the fastest by the launch model of benchmarks.predict at
vort-125m x 16,384 tokens on an H100 (256 classes, 12 heads, 8 banks of 18 terms) among 1-32 rows x 1-8
warps: forward 0.035 ms, backward 0.053 (16 rows, 4 warps: 0.092 and 0.203)."""


@triton.jit
def _order(logits_ptr, gate_ptr, bias_ptr, g_entropy_ptr, g_gate_ptr, banks_ptr, table_ptr, rows, delta,
           P: tl.constexpr, BP: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
           BS: tl.constexpr, BN: tl.constexpr):
    """This program's rows, recomputed alike forward and backward: the softmax p [BN, BP] and log p of the
    logits, the raw entropy [BN], the gate [BN], the per-head parameters [BH], sigma of the order's logit
    [BN, BH], the order, the order clamped to the banks, its bank pair's (low, high) coefficient rows
    [BN, BH, BS], the pair's width, and the masks."""
    row = tl.program_id(0) * BN + tl.arange(0, BN)
    live = row < rows
    cols = tl.arange(0, BP)
    at = row.to(tl.int64)[:, None] * P + cols[None, :]
    x = tl.load(logits_ptr + at, mask=live[:, None] & (cols < P)[None, :], other=-float("inf")).to(tl.float32)
    x = tl.where(live[:, None], x, 0.0)  # dead rows: a flat row, no NaN
    shifted = x - tl.max(x, 1)[:, None]
    e = tl.exp(shifted)
    total = tl.sum(e, 1)
    logp = shifted - tl.log(total)[:, None]
    p = e / total[:, None]
    entropy = -tl.sum(tl.where((cols < P)[None, :], p * logp, 0.0), 1)
    gate = tl.load(gate_ptr + row, mask=live, other=0.5).to(tl.float32)
    head = tl.arange(0, BH)
    hm = head < H
    bias = tl.load(bias_ptr + head, mask=hm, other=0.0).to(tl.float32)
    g_entropy = tl.load(g_entropy_ptr + head, mask=hm, other=0.0).to(tl.float32)
    g_gate = tl.load(g_gate_ptr + head, mask=hm, other=0.0).to(tl.float32)
    normalised = entropy / tl.log(P * 1.0)
    logit = (bias[None, :] + g_entropy[None, :] * (1.0 - normalised)[:, None]
             + g_gate[None, :] * (2.0 * gate - 1.0)[:, None])
    sig = tl.sigmoid(logit)
    alpha = delta + (1.0 - delta) * sig
    lowest = tl.load(banks_ptr)
    highest = tl.load(banks_ptr + K - 1)
    a = tl.minimum(tl.maximum(alpha, lowest), highest)
    idx = tl.zeros([BN, BH], dtype=tl.int32)
    for k in tl.static_range(K):  # banks at or below a (torch.searchsorted(..., right=True))
        idx += (tl.load(banks_ptr + k) <= a).to(tl.int32)
    idx = tl.minimum(tl.maximum(idx, 1), K - 1)
    left = tl.load(banks_ptr + idx - 1)
    width = tl.load(banks_ptr + idx) - left
    s = tl.arange(0, BS)
    at_low = (idx - 1)[:, :, None] * S + s[None, None, :]
    sm = (s < S)[None, None, :]
    low = tl.load(table_ptr + at_low, mask=sm, other=0.0).to(tl.float32)
    high = tl.load(table_ptr + at_low + S, mask=sm, other=0.0).to(tl.float32)
    return p, logp, entropy, gate, g_entropy, g_gate, normalised, sig, alpha, a, left, width, low, high, live, hm


@triton.jit
def _coef_block(rows, H: tl.constexpr, BH: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr):
    """This program's rows [BN], the heads [BH], and the offsets and mask of its [BN, BH, BS] block of a
    [rows, H, S] tensor."""
    row = tl.program_id(0) * BN + tl.arange(0, BN)
    head = tl.arange(0, BH)
    s = tl.arange(0, BS)
    at = row.to(tl.int64)[:, None, None] * (H * S) + head[None, :, None] * S + s[None, None, :]
    mask = (row < rows)[:, None, None] & (head < H)[None, :, None] & (s < S)[None, None, :]
    return row, head, at, mask


@triton.jit
def order_forward_kernel(logits_ptr, gate_ptr, bias_ptr, g_entropy_ptr, g_gate_ptr, banks_ptr, table_ptr, coef_ptr,
                         alpha_ptr, entropy_ptr, rows, delta, P: tl.constexpr, BP: tl.constexpr, H: tl.constexpr,
                         BH: tl.constexpr, K: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr):
    """coef [rows, H, S], alpha [rows, H] and the normalised entropy [rows], fp32."""
    (_p, _logp, _entropy, _gate, _ge, _gg, normalised, _sig, alpha, a, left, width, low, high, live,
     hm) = _order(logits_ptr, gate_ptr, bias_ptr, g_entropy_ptr, g_gate_ptr, banks_ptr, table_ptr, rows, delta, P,
                  BP, H, BH, K, S, BS, BN)
    row, head, at, mask = _coef_block(rows, H, BH, S, BS, BN)
    theta = ((a - left) / width)[:, :, None]
    tl.store(coef_ptr + at, low * (1.0 - theta) + high * theta, mask=mask)
    tl.store(alpha_ptr + row.to(tl.int64)[:, None] * H + head[None, :], alpha, mask=live[:, None] & hm[None, :])
    tl.store(entropy_ptr + row, normalised, mask=live)


@triton.jit
def order_backward_kernel(logits_ptr, gate_ptr, bias_ptr, g_entropy_ptr, g_gate_ptr, banks_ptr, table_ptr,
                          d_coef_ptr, d_logits_ptr, d_gate_ptr, d_params_ptr, rows, delta, P: tl.constexpr,
                          BP: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
                          BS: tl.constexpr, BN: tl.constexpr):
    """From d coef [rows, H, S]: d logits [rows, P] (the logits' dtype), d gate [rows] (fp32) and this program's
    shares of d bias, d entropy gain and d gate gain, row program_id of d_params [programs, 3, H] (fp32).
    Through the interpolation d alpha = sum_s d coef (high - low) / width inside the banks' range (0 where
    the clamp holds alpha); d logit = (1 - delta) sigma (1 - sigma) d alpha; d entropy (normalised) =
    -sum_h g_entropy d logit, d gate = 2 sum_h g_gate d logit; through the entropy H = -sum p log p of the
    softmax, d x_j = -p_j (log p_j + H) dH."""
    (p, logp, entropy, gate, g_entropy, g_gate, normalised, sig, alpha, _a, _left, width, low, high, live,
     hm) = _order(logits_ptr, gate_ptr, bias_ptr, g_entropy_ptr, g_gate_ptr, banks_ptr, table_ptr, rows, delta, P,
                  BP, H, BH, K, S, BS, BN)
    row, head, at, mask = _coef_block(rows, H, BH, S, BS, BN)
    d_coef = tl.load(d_coef_ptr + at, mask=mask, other=0.0).to(tl.float32)
    d_theta = tl.sum(d_coef * (high - low), 2)
    inside = (alpha >= tl.load(banks_ptr)) & (alpha <= tl.load(banks_ptr + K - 1))
    d_logit = tl.where(inside, d_theta / width, 0.0) * (1.0 - delta) * sig * (1.0 - sig)
    d_logit = tl.where(live[:, None] & hm[None, :], d_logit, 0.0)
    d_normalised = -tl.sum(d_logit * g_entropy[None, :], 1)
    d_gate = 2.0 * tl.sum(d_logit * g_gate[None, :], 1)
    tl.store(d_gate_ptr + row, d_gate, mask=live)
    d_entropy = d_normalised / tl.log(P * 1.0)
    cols = tl.arange(0, BP)
    d_x = -p * (logp + entropy[:, None]) * d_entropy[:, None]
    tl.store(d_logits_ptr + row.to(tl.int64)[:, None] * P + cols[None, :], d_x.to(d_logits_ptr.dtype.element_ty),
             mask=live[:, None] & (cols < P)[None, :])
    shares = d_params_ptr + tl.program_id(0) * 3 * H + head
    tl.store(shares, tl.sum(d_logit, 0), mask=hm)
    tl.store(shares + H, tl.sum(d_logit * (1.0 - normalised)[:, None], 0), mask=hm)
    tl.store(shares + 2 * H, tl.sum(d_logit * (2.0 * gate - 1.0)[:, None], 0), mask=hm)


def order_launch(name: str, rows: int, classes: int, heads: int, banks: int, terms: int, dtype: torch.dtype,
                 param_dtype: torch.dtype) -> Launch:
    """The forward ("forward") or backward ("backward") launch over ``rows`` rows of ``classes`` logits of
    ``dtype``, ``heads`` heads, ``banks`` banks of ``terms`` coefficients, parameters of ``param_dtype``."""
    operand, param = triton_type(dtype), triton_type(param_dtype)
    shared = {"logits_ptr": operand, "gate_ptr": "fp32", "bias_ptr": param, "g_entropy_ptr": param,
              "g_gate_ptr": param, "banks_ptr": "fp32", "table_ptr": "fp32"}
    if name == "forward":
        kernel = order_forward_kernel
        pointers = shared | {"coef_ptr": "fp32", "alpha_ptr": "fp32", "entropy_ptr": "fp32"}
    else:
        kernel = order_backward_kernel
        pointers = shared | {"d_coef_ptr": "fp32", "d_logits_ptr": operand, "d_gate_ptr": "fp32",
                             "d_params_ptr": "fp32"}
    constexprs = {"P": classes, "BP": triton.next_power_of_2(classes), "H": heads,
                  "BH": max(2, triton.next_power_of_2(heads)), "K": banks, "S": terms,
                  "BS": max(2, triton.next_power_of_2(terms)), "BN": SHAPES[name][0]}
    wide = frozenset({"logits_ptr", "coef_ptr", "d_coef_ptr", "d_logits_ptr", "alpha_ptr"})
    return Launch(kernel, pointers, {"rows": "i32", "delta": "fp32"}, constexprs,
                  (triton.cdiv(rows, SHAPES[name][0]), 1, 1), SHAPES[name][1], 1, wide=wide & frozenset(pointers))


def _flat(logits: Tensor, gate: Tensor) -> tuple[Tensor, Tensor]:
    return logits.contiguous().view(-1, logits.shape[-1]), gate.float().contiguous().view(-1)


def forward(logits: Tensor, gate: Tensor, bias: Tensor, g_entropy: Tensor, g_gate: Tensor, banks: Tensor,
            table: Tensor, delta: float) -> tuple[Tensor, Tensor, Tensor]:
    """(coef [..., H, S], alpha [..., H], normalised entropy [...]), fp32."""
    flat, gate_flat = _flat(logits, gate)
    rows, heads, terms = flat.shape[0], bias.shape[0], table.shape[1]
    coef = torch.empty(rows, heads, terms, dtype=torch.float32, device=flat.device)
    alpha = torch.empty(rows, heads, dtype=torch.float32, device=flat.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=flat.device)
    launch = order_launch("forward", rows, flat.shape[1], heads, banks.shape[0], terms, flat.dtype, bias.dtype)
    launch.run(flat, gate_flat, bias, g_entropy, g_gate, banks.float().contiguous(), table.float().contiguous(), coef,
               alpha, entropy, rows, delta)
    lead = logits.shape[:-1]
    return coef.view(*lead, heads, terms), alpha.view(*lead, heads), entropy.view(lead)


def backward(logits: Tensor, gate: Tensor, bias: Tensor, g_entropy: Tensor, g_gate: Tensor, banks: Tensor,
             table: Tensor, delta: float, d_coef: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d logits, d gate, d bias, d entropy gain, d gate gain), each in its input's dtype."""
    flat, gate_flat = _flat(logits, gate)
    rows, heads, terms = flat.shape[0], bias.shape[0], table.shape[1]
    launch = order_launch("backward", rows, flat.shape[1], heads, banks.shape[0], terms, flat.dtype, bias.dtype)
    d_logits = torch.empty_like(flat)
    d_gate = torch.empty(rows, dtype=torch.float32, device=flat.device)
    shares = torch.empty(launch.programs, 3, heads, dtype=torch.float32, device=flat.device)
    launch.run(flat, gate_flat, bias, g_entropy, g_gate, banks.float().contiguous(), table.float().contiguous(),
               d_coef.float().contiguous().view(rows, heads, terms), d_logits, d_gate, shares, rows, delta)
    d_params = shares.sum(0)  # [3, H]: each row copied out, so that no two returned gradients share storage
    return (d_logits.view(logits.shape), d_gate.view(gate.shape).to(gate.dtype),
            *(d_params[i].to(p.dtype, copy=True) for i, p in enumerate((bias, g_entropy, g_gate))))

