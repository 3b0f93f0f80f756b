"""Triton kernels of the fused SwiGLU gate (kernels/swiglu/__init__.py has the op): one program per block of
rows x columns of the [rows, 2H] projection (gate columns, then up columns). The forward writes
silu(gate) * up; the backward reads the projection and the gradient and writes both halves of the
projection's gradient in place, so no concatenation follows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._common import Launch, triton_type

SHAPES = {"forward": (8, 256, 4), "backward": (8, 256, 4)}
"""(rows, columns, warps) of each kernel's program. Both kernels are bandwidth-bound: the launch model of
benchmarks.predict prices every shape of 1-16 rows x 128-1024 columns x 2-8 warps at its HBM floor for
vort-125m's [16,384, 2 x 2048] bf16 projection on an H100 (forward 0.087 ms, backward 0.136)."""


@triton.jit
def _halves(gu_ptr, rows, H: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """This program's block of the gate and up halves (fp32, zero outside), their offsets and mask."""
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    col = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (row < rows)[:, None] & (col < H)[None, :]
    at = row.to(tl.int64)[:, None] * (2 * H) + col[None, :]
    gate = tl.load(gu_ptr + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at + H, mask=mask, other=0.0).to(tl.float32)
    return gate, up, at, mask, row, col


@triton.jit
def swiglu_forward_kernel(gu_ptr, h_ptr, rows, H: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """h = silu(gate) * up, in fp32, stored once in h's dtype ([rows, H])."""
    gate, up, _at, mask, row, col = _halves(gu_ptr, rows, H, BR, BC)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + row.to(tl.int64)[:, None] * H + col[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(gu_ptr, dh_ptr, dgu_ptr, rows, H: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """d gate = dh up silu'(gate), silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g); d up = dh silu(gate):
    stored as the two halves of d_gate_up ([rows, 2H], its dtype)."""
    gate, up, at, mask, row, col = _halves(gu_ptr, rows, H, BR, BC)
    dh = tl.load(dh_ptr + row.to(tl.int64)[:, None] * H + col[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = dh * up * s * (1.0 + gate * (1.0 - s))
    d_up = dh * gate * s
    tl.store(dgu_ptr + at, d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu_ptr + at + H, d_up.to(dgu_ptr.dtype.element_ty), mask=mask)


def swiglu_launch(name: str, rows: int, hidden: int, dtype: torch.dtype) -> Launch:
    """The forward ("forward") or backward ("backward") launch over ``rows`` rows of a [rows, 2 * hidden]
    projection of ``dtype``."""
    operand = triton_type(dtype)
    if name == "forward":
        kernel, pointers = swiglu_forward_kernel, {"gu_ptr": operand, "h_ptr": operand}
    else:
        kernel, pointers = swiglu_backward_kernel, {"gu_ptr": operand, "dh_ptr": operand, "dgu_ptr": operand}
    block_rows, block_cols, warps = SHAPES[name]
    block_cols = min(block_cols, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(hidden, block_cols), 1)
    return Launch(kernel, pointers, {"rows": "i32"}, {"H": hidden, "BR": block_rows, "BC": block_cols}, grid, warps,
                  1, wide=frozenset(pointers))


def forward(gate_up: Tensor) -> Tensor:
    """silu(gate) * up [..., H] of gate_up [..., 2H], in its dtype."""
    flat = gate_up.contiguous().view(-1, gate_up.shape[-1])
    hidden = flat.shape[1] // 2
    h = torch.empty(flat.shape[0], hidden, dtype=flat.dtype, device=flat.device)
    swiglu_launch("forward", flat.shape[0], hidden, flat.dtype).run(flat, h, flat.shape[0])
    return h.view(*gate_up.shape[:-1], hidden)


def backward(gate_up: Tensor, dh: Tensor) -> Tensor:
    """The gradient of gate_up [..., 2H] from dh [..., H], in gate_up's dtype."""
    flat = gate_up.contiguous().view(-1, gate_up.shape[-1])
    hidden = flat.shape[1] // 2
    dgu = torch.empty_like(flat)
    swiglu_launch("backward", flat.shape[0], hidden, flat.dtype).run(
        flat, dh.to(flat.dtype).contiguous().view(-1, hidden), dgu, flat.shape[0])
    return dgu.view(gate_up.shape)
