"""Triton kernels of the fused RMS norm (kernels/norm/__init__.py has the op): one program per few rows
(SHAPES) of the [rows, D] input, a whole row in registers. The forward writes y; the backward recomputes the row's
1 / rms from x (one more pass over a row it reads anyway, instead of a saved [rows] tensor), writes dx and
each program's share of the weight's gradient, which the op then sums over the programs in a fixed order
(no atomics: the same gradient every run)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import Launch, triton_type

SHAPES = {"forward": (4, 4), "backward": (2, 4)}
"""(rows per program, warps) of each kernel: the fastest by the launch model of benchmarks.predict for
vort-125m's [16,384, 768] bf16 rows on an H100 (forward 0.032 ms, at its HBM floor plus a launch, for 1-4
rows a program; backward 0.043 ms at 1-2 rows, 0.12 at 16, whose 255 registers leave two programs an SM;
2 rows halve the shares of dw that the op then sums)."""


@triton.jit
def _rows(x_ptr, w_ptr, rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, eps):
    """This program's rows of x [BR, BD], fp32 (zero past D and past the last row), their 1 / rms
    [BR], the weight [BD] in fp32, the mask and the offsets of the block."""
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    col = tl.arange(0, BD)
    mask = (row < rows)[:, None] & (col < D)[None, :]
    at = row.to(tl.int64)[:, None] * D + col[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + col, mask=col < D, other=0.0).to(tl.float32)
    return x, inv, w, mask, at


@triton.jit
def rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rows, eps, D: tl.constexpr, BD: tl.constexpr,
                            BR: tl.constexpr):
    """y = x / rms(x) * w for BR rows, in fp32, stored in y's dtype."""
    x, inv, w, mask, at = _rows(x_ptr, w_ptr, rows, D, BD, BR, eps)
    tl.store(y_ptr + at, (x * inv[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, rows, eps, D: tl.constexpr, BD: tl.constexpr,
                             BR: tl.constexpr):
    """dx = (g - n mean(g n)) / rms(x) with n = x / rms(x), g = dy w, for BR rows (in dx's dtype); and
    this program's share of dw, sum over its rows of dy n, as row program_id of dw ([programs, D] fp32)."""
    x, inv, w, mask, at = _rows(x_ptr, w_ptr, rows, D, BD, BR, eps)
    dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
    n = x * inv[:, None]
    g = dy * w[None, :]
    along = tl.sum(g * n, 1) / D
    dx = (g - n * along[:, None]) * inv[:, None]
    tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    col = tl.arange(0, BD)
    tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * D + col, tl.sum(dy * n, 0), mask=col < D)


def norm_launch(name: str, rows: int, dim: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> Launch:
    """The forward ("forward") or backward ("backward") launch over ``rows`` rows of ``dim`` columns of
    ``dtype``, the weight in ``weight_dtype``."""
    operand, weight = triton_type(dtype), triton_type(weight_dtype)
    if name == "forward":
        kernel, pointers = rms_norm_forward_kernel, {"x_ptr": operand, "w_ptr": weight, "y_ptr": operand}
    else:
        kernel = rms_norm_backward_kernel
        pointers = {"x_ptr": operand, "w_ptr": weight, "dy_ptr": operand, "dx_ptr": operand, "dw_ptr": "fp32"}
    block_rows, warps = SHAPES[name]
    constexprs = {"D": dim, "BD": triton.next_power_of_2(dim), "BR": block_rows}
    return Launch(kernel, pointers, {"rows": "i32", "eps": "fp32"}, constexprs, (triton.cdiv(rows, block_rows), 1, 1),
                  warps, 1, wide=frozenset(n for n in pointers if n != "w_ptr"))


def forward(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y [..., D] in x's dtype."""
    flat = x.contiguous().view(-1, x.shape[-1])
    y = torch.empty_like(flat)
    norm_launch("forward", flat.shape[0], flat.shape[1], x.dtype, weight.dtype).run(flat, weight, y, flat.shape[0],
                                                                                      eps)
    return y.view(x.shape)


def backward(x: Tensor, weight: Tensor, dy: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dw in the weight's dtype): the programs' shares of dw summed in order."""
    flat = x.contiguous().view(-1, x.shape[-1])
    launch = norm_launch("backward", flat.shape[0], flat.shape[1], x.dtype, weight.dtype)
    dx = torch.empty_like(flat)
    shares = torch.empty(launch.programs, flat.shape[1], dtype=torch.float32, device=x.device)
    launch.run(flat, weight, dy.to(x.dtype).contiguous().view(flat.shape), dx, shares, flat.shape[0], eps)
    return dx.view(x.shape), shares.sum(0).to(weight.dtype)
