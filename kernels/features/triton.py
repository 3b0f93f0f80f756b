"""Triton kernels of the fused feature map (kernels/features/__init__.py has the map and the ops): the
forward writes phi, the backward recomputes it and writes dx; one program per BLOCK_ROWS tokens of a head.
A head's D columns are read as two halves, the pairs the rotary rotation turns (when it is on)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import Launch, check_triton_inputs, triton_type

BLOCK_ROWS = 64  # tokens per program
WARPS = 4


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tile(ptr, rows_at, col, HALF: tl.constexpr, BH: tl.constexpr, live):
    """Columns col..col + HALF [BT, BH] of the rows at ``rows_at``, as fp32 (zero in the padding)."""
    c = tl.arange(0, BH)
    mask = live[:, None] & (c[None, :] < HALF)
    return tl.load(ptr + rows_at[:, None] + col + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _features(x_ptr, w_ptr, cos_ptr, sin_ptr, rows, seq_len, stride_row, stride_head, stride_angles, scale, eps,
              HALF: tl.constexpr, F_: tl.constexpr, BH: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr,
              ROTATE: tl.constexpr, PRECISION: tl.constexpr):
    """One program's rows of one head, all fp32: the angles' (cos, sin), the rotated x as two halves
    (r1, r2), 1 / max(|r|, eps), |r| > eps, y = s r / max(|r|, eps) as (y1, y2), and phi. The product with
    W is two products over the halves' columns."""
    row = tl.program_id(0) * BT + tl.arange(0, BT)
    head = tl.program_id(1)
    c = tl.arange(0, BH)
    f = tl.arange(0, BF)
    live = row < rows
    x_at = row.to(tl.int64) * stride_row
    x1 = _tile(x_ptr, x_at, head * stride_head, HALF, BH, live)
    x2 = _tile(x_ptr, x_at, head * stride_head + HALF, HALF, BH, live)
    if ROTATE:  # angles per position: [T, HALF] shared by the rows (stride_angles 0) or [B, T, HALF]
        at = (row // seq_len).to(tl.int64) * stride_angles + (row % seq_len) * HALF
        cos, sin = _tile(cos_ptr, at, 0, HALF, BH, live), _tile(sin_ptr, at, 0, HALF, BH, live)
        r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    else:
        cos, sin = x1, x2  # unused
        r1, r2 = x1, x2
    norm = tl.sqrt(tl.sum(r1 * r1, 1) + tl.sum(r2 * r2, 1))
    inv = 1.0 / tl.maximum(norm, eps)
    y1, y2 = r1 * (inv * scale)[:, None], r2 * (inv * scale)[:, None]
    w_mask = (c[:, None] < HALF) & (f[None, :] < F_)
    w_at = w_ptr + head * F_ * 2 * HALF + f[None, :] * 2 * HALF + c[:, None]  # W_h transposed, by halves
    proj = tl.dot(y1, tl.load(w_at, mask=w_mask, other=0.0), input_precision=PRECISION)
    proj += tl.dot(y2, tl.load(w_at + HALF, mask=w_mask, other=0.0), input_precision=PRECISION)
    square = tl.sum(y1 * y1, 1) + tl.sum(y2 * y2, 1)
    phi = tl.exp(proj - 0.5 * square[:, None]) * (1.0 / tl.sqrt(F_ * 1.0))
    return cos, sin, r1, r2, inv, norm > eps, y1, y2, phi


@triton.jit
def features_forward_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rows, seq_len, stride_row, stride_head,
                            stride_angles, scale, eps, H: tl.constexpr, HALF: tl.constexpr, F_: tl.constexpr,
                            BH: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, ROTATE: tl.constexpr,
                            PRECISION: tl.constexpr):
    """phi of BT rows of one head, stored in out's dtype ([rows, H, F] contiguous)."""
    phi = _features(x_ptr, w_ptr, cos_ptr, sin_ptr, rows, seq_len, stride_row, stride_head, stride_angles, scale,
                    eps, HALF, F_, BH, BF, BT, ROTATE, PRECISION)[8]
    row = tl.program_id(0) * BT + tl.arange(0, BT)
    f = tl.arange(0, BF)
    at = row.to(tl.int64)[:, None] * (H * F_) + tl.program_id(1) * F_ + f[None, :]
    tl.store(out_ptr + at, phi.to(out_ptr.dtype.element_ty), mask=(row < rows)[:, None] & (f[None, :] < F_))


@triton.jit
def features_backward_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, d_phi_ptr, dx_ptr, rows, seq_len, stride_row,
                             stride_head, stride_angles, scale, eps, H: tl.constexpr, HALF: tl.constexpr,
                             F_: tl.constexpr, BH: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr,
                             ROTATE: tl.constexpr, PRECISION: tl.constexpr):
    """dx of BT rows of one head ([rows, H, D] contiguous, in dx's dtype) from dphi, phi recomputed:
    d proj = dphi phi; dy = W^T d proj - y sum(d proj); dn = s dy; dr = (dn - n (n . dn)) / |r| (dn / eps
    where |r| <= eps, as F.normalize's floor); dx = the rotation's transpose applied to dr."""
    cos, sin, r1, r2, inv, big, y1, y2, phi = _features(x_ptr, w_ptr, cos_ptr, sin_ptr, rows, seq_len, stride_row,
                                                        stride_head, stride_angles, scale, eps, HALF, F_, BH, BF, BT,
                                                        ROTATE, PRECISION)
    row = tl.program_id(0) * BT + tl.arange(0, BT)
    head = tl.program_id(1)
    c = tl.arange(0, BH)
    f = tl.arange(0, BF)
    live = row < rows
    g = tl.load(d_phi_ptr + row.to(tl.int64)[:, None] * (H * F_) + head * F_ + f[None, :],
                mask=live[:, None] & (f[None, :] < F_), other=0.0).to(tl.float32)
    d_proj = g * phi
    total = tl.sum(d_proj, 1)[:, None]
    w_mask = (f[:, None] < F_) & (c[None, :] < HALF)
    w_at = w_ptr + head * F_ * 2 * HALF + f[:, None] * 2 * HALF + c[None, :]  # W_h by halves: [F, HALF]
    dn1 = (tl.dot(d_proj, tl.load(w_at, mask=w_mask, other=0.0), input_precision=PRECISION) - y1 * total) * scale
    dn2 = (tl.dot(d_proj, tl.load(w_at + HALF, mask=w_mask, other=0.0), input_precision=PRECISION) - y2 * total) * scale
    n1, n2 = r1 * inv[:, None], r2 * inv[:, None]
    along = (tl.sum(n1 * dn1, 1) + tl.sum(n2 * dn2, 1))[:, None]
    dr1 = tl.where(big[:, None], dn1 - n1 * along, dn1) * inv[:, None]
    dr2 = tl.where(big[:, None], dn2 - n2 * along, dn2) * inv[:, None]
    if ROTATE:
        dx1, dx2 = dr1 * cos + dr2 * sin, dr2 * cos - dr1 * sin
    else:
        dx1, dx2 = dr1, dr2
    at = row.to(tl.int64)[:, None] * (H * 2 * HALF) + head * 2 * HALF + c[None, :]
    mask = live[:, None] & (c[None, :] < HALF)
    tl.store(dx_ptr + at, dx1.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + at + HALF, dx2.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launches and ops


def _rows(x: Tensor) -> tuple[Tensor, int, int]:
    """x as [rows, H, D] with unit stride along D, with its row and head strides: a view where the leading
    dimensions merge (q of a [B, T, 3, H, D] projection does), else a copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        flat = x.view(-1, *x.shape[-2:])
    except RuntimeError:  # leading dimensions that do not merge
        flat = x.contiguous().view(-1, *x.shape[-2:])
    return flat, flat.stride(0), flat.stride(1)


def feature_launch(name: str, rows: int, heads: int, dim: int, n_features: int, dtype: torch.dtype,
                   rotate: bool) -> Launch:
    """The forward ("forward") or backward ("backward") launch over ``rows`` tokens of ``heads`` heads of
    ``dim`` (even) columns, with or without the rotation."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    kernel = features_forward_kernel if name == "forward" else features_backward_kernel
    tensors = ("x_ptr", "w_ptr", "cos_ptr", "sin_ptr") + (("out_ptr",) if name == "forward" else ("d_phi_ptr",
                                                                                                    "dx_ptr"))
    pointers = {n: ("fp32" if n in ("w_ptr", "cos_ptr", "sin_ptr") else triton_type(dtype)) for n in tensors}
    constexprs = {"H": heads, "HALF": dim // 2, "F_": n_features, "BH": max(16, triton.next_power_of_2(dim // 2)),
                  "BF": max(16, triton.next_power_of_2(n_features)), "BT": BLOCK_ROWS, "ROTATE": rotate,
                  "PRECISION": precision}
    scalars = {"rows": "i32", "seq_len": "i32", "stride_row": "i64", "stride_head": "i32", "stride_angles": "i64",
               "scale": "fp32", "eps": "fp32"}
    return Launch(kernel, pointers, scalars, constexprs, (triton.cdiv(rows, BLOCK_ROWS), heads, 1), WARPS, 1,
                  wide=frozenset(n for n in tensors if n != "w_ptr"))


def _angles(w: Tensor, cos: Tensor | None, sin: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """(cos, sin) as fp32 contiguous tables and their batch stride (0 when the rows share [T, D/2]); the fp32
    weight ``w`` as placeholders without a rotation (the kernel reads neither)."""
    if cos is None:
        return w, w, 0
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return cos, sin, (cos.stride(0) if cos.dim() == 3 else 0)


def _run(name: str, x: Tensor, weight: Tensor, cos: Tensor | None, sin: Tensor | None, tensors: tuple[Tensor, ...],
         scale: float, eps: float) -> None:
    """Launch the ``name`` kernel over x [B, T, H, D] with ``tensors``, its own arguments after the tables."""
    flat, stride_row, stride_head = _rows(x)
    rows, heads, dim = flat.shape
    w = weight.float().contiguous()
    launch = feature_launch(name, rows, heads, dim, weight.shape[1], x.dtype, cos is not None)
    cos, sin, stride_angles = _angles(w, cos, sin)
    launch.run(flat, w, cos, sin, *tensors, rows, x.shape[1], stride_row, stride_head, stride_angles, scale, eps)


def forward(x: Tensor, weight: Tensor, scale: float, cos: Tensor | None, sin: Tensor | None, eps: float) -> Tensor:
    """phi(x) in x's dtype (x [B, T, H, D])."""
    check_triton_inputs(x, features_forward_kernel)
    out = torch.empty(*x.shape[:-1], weight.shape[1], dtype=x.dtype, device=x.device)
    _run("forward", x, weight, cos, sin, (out,), scale, eps)
    return out


def backward(x: Tensor, weight: Tensor, d_phi: Tensor, scale: float, cos: Tensor | None, sin: Tensor | None,
             eps: float) -> Tensor:
    """dx (contiguous, x's dtype) from dphi."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _run("backward", x, weight, cos, sin, (d_phi.to(x.dtype).contiguous(), dx), scale, eps)
    return dx
