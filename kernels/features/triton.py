"""Triton kernels of the fused feature map (kernels/features/__init__.py has the map and the ops): the
forward writes phi, the backward recomputes it and writes dx; one program per BLOCK_ROWS tokens of a head."""

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
def _features(x_ptr, w_ptr, rows, stride_row, stride_head, scale, eps,
              D: tl.constexpr, F_: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr,
              PRECISION: tl.constexpr):
    """One program's rows of one head: (x, 1 / max(|x|, eps), |x| > eps, y, phi), all fp32."""
    row = tl.program_id(0) * BT + tl.arange(0, BT)
    head = tl.program_id(1)
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    live = row < rows
    offsets = row.to(tl.int64)[:, None] * stride_row + head * stride_head + d[None, :]
    x = tl.load(x_ptr + offsets, mask=live[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, 1))
    inv = 1.0 / tl.maximum(norm, eps)
    y = x * (inv * scale)[:, None]
    w_t = tl.load(w_ptr + head * F_ * D + f[None, :] * D + d[:, None], mask=(d[:, None] < D) & (f[None, :] < F_),
                  other=0.0)  # W_h transposed: [D, F]
    proj = tl.dot(y, w_t, input_precision=PRECISION)
    phi = tl.exp(proj - 0.5 * tl.sum(y * y, 1)[:, None]) * (1.0 / tl.sqrt(F_ * 1.0))
    return x, inv, norm > eps, y, phi


@triton.jit
def features_forward_kernel(x_ptr, w_ptr, out_ptr, rows, stride_row, stride_head, scale, eps, H: tl.constexpr,
                            D: tl.constexpr, F_: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
                            BT: tl.constexpr, PRECISION: tl.constexpr):
    """phi of BT rows of one head, stored in out's dtype ([rows, H, F] contiguous)."""
    _x, _inv, _big, _y, phi = _features(x_ptr, w_ptr, rows, stride_row, stride_head, scale, eps, D, F_, BD, BF, BT,
                                        PRECISION)
    row = tl.program_id(0) * BT + tl.arange(0, BT)
    f = tl.arange(0, BF)
    at = row.to(tl.int64)[:, None] * (H * F_) + tl.program_id(1) * F_ + f[None, :]
    tl.store(out_ptr + at, phi.to(out_ptr.dtype.element_ty), mask=(row < rows)[:, None] & (f[None, :] < F_))


@triton.jit
def features_backward_kernel(x_ptr, w_ptr, d_phi_ptr, dx_ptr, rows, stride_row, stride_head, scale, eps,
                             H: tl.constexpr, D: tl.constexpr, F_: tl.constexpr, BD: tl.constexpr,
                             BF: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr):
    """dx of BT rows of one head ([rows, H, D] contiguous, in dx's dtype) from dphi, phi recomputed:
    d proj = dphi phi; dy = W^T d proj - y sum(d proj); dn = s dy; dx = (dn - n (n . dn)) / |x|
    (dn / eps where |x| <= eps, as F.normalize's floor)."""
    x, inv, big, y, phi = _features(x_ptr, w_ptr, rows, stride_row, stride_head, scale, eps, D, F_, BD, BF, BT,
                                    PRECISION)
    row = tl.program_id(0) * BT + tl.arange(0, BT)
    head = tl.program_id(1)
    d = tl.arange(0, BD)
    f = tl.arange(0, BF)
    live = row < rows
    g = tl.load(d_phi_ptr + row.to(tl.int64)[:, None] * (H * F_) + head * F_ + f[None, :],
                mask=live[:, None] & (f[None, :] < F_), other=0.0).to(tl.float32)
    d_proj = g * phi
    w = tl.load(w_ptr + head * F_ * D + f[:, None] * D + d[None, :], mask=(f[:, None] < F_) & (d[None, :] < D),
                other=0.0)  # W_h: [F, D]
    dy = tl.dot(d_proj, w, input_precision=PRECISION) - y * tl.sum(d_proj, 1)[:, None]
    dn = dy * scale
    n = x * inv[:, None]
    dx = tl.where(big[:, None], dn - n * tl.sum(n * dn, 1)[:, None], dn) * inv[:, None]
    at = row.to(tl.int64)[:, None] * (H * D) + head * D + d[None, :]
    tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=live[:, None] & (d[None, :] < D))


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


def feature_launch(name: str, rows: int, heads: int, dim: int, n_features: int, dtype: torch.dtype) -> Launch:
    """The forward ("forward") or backward ("backward") launch over ``rows`` tokens of ``heads`` heads."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    kernel = features_forward_kernel if name == "forward" else features_backward_kernel
    tensors = ("x_ptr", "w_ptr", "out_ptr") if name == "forward" else ("x_ptr", "w_ptr", "d_phi_ptr", "dx_ptr")
    pointers = {n: ("fp32" if n == "w_ptr" else triton_type(dtype)) for n in tensors}
    constexprs = {"H": heads, "D": dim, "F_": n_features, "BD": max(16, triton.next_power_of_2(dim)),
                  "BF": max(16, triton.next_power_of_2(n_features)), "BT": BLOCK_ROWS, "PRECISION": precision}
    scalars = {"rows": "i32", "stride_row": "i64", "stride_head": "i32", "scale": "fp32", "eps": "fp32"}
    return Launch(kernel, pointers, scalars, constexprs, (triton.cdiv(rows, BLOCK_ROWS), heads, 1), WARPS, 1,
                  wide=frozenset(n for n in tensors if n != "w_ptr"))


def forward(x: Tensor, weight: Tensor, scale: float, eps: float) -> Tensor:
    """phi(x) in x's dtype."""
    check_triton_inputs(x, features_forward_kernel)
    flat, stride_row, stride_head = _rows(x)
    rows, heads, dim = flat.shape
    n_features = weight.shape[1]
    out = torch.empty(*x.shape[:-1], n_features, dtype=x.dtype, device=x.device)
    w = weight.float().contiguous()
    feature_launch("forward", rows, heads, dim, n_features, x.dtype).run(flat, w, out, rows, stride_row, stride_head,
                                                                         scale, eps)  # fmt: skip
    return out


def backward(x: Tensor, weight: Tensor, d_phi: Tensor, scale: float, eps: float) -> Tensor:
    """dx (contiguous, x's dtype) from dphi."""
    flat, stride_row, stride_head = _rows(x)
    rows, heads, dim = flat.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.float().contiguous()
    feature_launch("backward", rows, heads, dim, weight.shape[1], x.dtype).run(
        flat, w, d_phi.to(x.dtype).contiguous(), dx, rows, stride_row, stride_head, scale, eps)
    return dx
