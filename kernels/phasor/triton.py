"""Triton kernels for the phasor scan (the CUDA path; also runs under TRITON_INTERPRET=1 on CPU tensors).

One program per (batch, block of phase columns) keeps every slot's phase [n_slots, BM] in registers,
in fp32, wrapped to [0, 2*pi) after each chunk, and walks the sequence in chunks of BT tokens. Per
chunk and level, with onehot[t, n] = (slots[t] == n):
  read  = wrap(onehot @ state + same_slot_before @ delta),  same_slot_before[t, j] = (slot_t == slot_j and j < t)
  state += onehot^T @ delta
Levels never share a slot, so updating the state level by level does not change the next level's reads.
The backward is the same walk in reverse with the read gradients: d delta = onehot @ g + same_slot_after @ d_read.
All products use IEEE fp32 (no TF32) so phases keep full fp32 precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import Launch, check_triton_inputs, device_capability, triton_type


@triton.jit
def _wrap(x):
    y = x - 6.283185307179586 * tl.floor(x * 0.15915494309189535)
    return tl.where(y >= 6.283185307179586, y - 6.283185307179586, y)


@triton.jit
def _slot_tile(M, NS, BT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's batch row, phase columns, slot rows and chunk positions, and the offsets and mask
    of its state tile [BN, BM] in a [B, NS, M] state."""
    b = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_t = tl.arange(0, BT)
    mask_m = offs_m < M
    st_off = (b * NS + offs_n[:, None]) * M + offs_m[None, :]
    st_mask = (offs_n < NS)[:, None] & mask_m[None, :]
    return b, offs_m, offs_n, offs_t, mask_m, st_off, st_mask


@triton.jit
def _level_rows(values, slots, b, t, lvl, seq_len, L, M, offs_m, offs_n, mask_m):
    """Level ``lvl`` of tokens ``t``: flat row ids, the [BT, BM] mask, each token's slot, its one-hot
    over the slot rows, and the rows of ``values`` (an increment or its gradient) in fp32."""
    mask_t = t < seq_len
    entry = ((b * seq_len + t) * L + lvl).to(tl.int64)
    sl = tl.load(slots + entry, mask=mask_t, other=-1)
    mask = mask_t[:, None] & mask_m[None, :]
    rows = tl.load(values + entry[:, None] * M + offs_m[None, :], mask=mask, other=0.0).to(tl.float32)
    onehot = (sl[:, None] == offs_n[None, :]).to(tl.float32)
    return entry, mask, sl, onehot, rows


@triton.jit
def _phasor_fwd_kernel(
    delta, slots, init, read, final, seq_len, L, M, NS, BT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr
):
    b, offs_m, offs_n, offs_t, mask_m, st_off, st_mask = _slot_tile(M, NS, BT, BM, BN)
    state = tl.load(init + st_off, mask=st_mask, other=0.0)
    before = offs_t[:, None] > offs_t[None, :]
    for start in range(0, seq_len, BT):
        t = start + offs_t
        for lvl in range(0, L):
            entry, mask, sl, onehot, d = _level_rows(delta, slots, b, t, lvl, seq_len, L, M, offs_m, offs_n, mask_m)
            same = ((sl[:, None] == sl[None, :]) & before).to(tl.float32)
            r = tl.dot(onehot, state, input_precision="ieee") + tl.dot(same, d, input_precision="ieee")
            tl.store(read + entry[:, None] * M + offs_m[None, :], _wrap(r), mask=mask)
            state += tl.dot(tl.trans(onehot), d, input_precision="ieee")
        state = _wrap(state)
    tl.store(final + st_off, state, mask=st_mask)


@triton.jit
def _phasor_bwd_kernel(
    d_read, slots, d_final, d_delta, d_init, seq_len, L, M, NS, BT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr
):
    b, offs_m, offs_n, offs_t, mask_m, st_off, st_mask = _slot_tile(M, NS, BT, BM, BN)
    g_state = tl.load(d_final + st_off, mask=st_mask, other=0.0)
    after = offs_t[:, None] < offs_t[None, :]
    n_chunks = tl.cdiv(seq_len, BT)
    for rev in range(0, n_chunks):
        t = (n_chunks - 1 - rev) * BT + offs_t
        for lvl in range(0, L):
            entry, mask, sl, onehot, g = _level_rows(d_read, slots, b, t, lvl, seq_len, L, M, offs_m, offs_n, mask_m)
            same = ((sl[:, None] == sl[None, :]) & after).to(tl.float32)
            gd = tl.dot(onehot, g_state, input_precision="ieee") + tl.dot(same, g, input_precision="ieee")
            tl.store(d_delta + entry[:, None] * M + offs_m[None, :], gd, mask=mask)
            g_state += tl.dot(tl.trans(onehot), g, input_precision="ieee")
    tl.store(d_init + st_off, g_state, mask=st_mask)


# Per target: (tokens per chunk, widest block of phase columns, warps, pipeline stages). The compile
# gate (benchmarks/kernel_compile.py) checks every entry against the target's shared memory and registers.
_TABLE: dict[bool, tuple[int, int, int, int]] = {
    # sm_90 or newer
    False: (16, 16, 8, 2),
    True: (16, 16, 8, 2),
}


def phasor_launches(
    batch: int, seq_len: int, levels: int, width: int, n_slots: int, dtype: torch.dtype, capability: int
) -> dict[str, Launch]:
    """The launches of one scan ("fwd", "bwd") for increments of ``dtype`` on a GPU of compute capability
    ``capability``. Chunk, column and padded slot blocks are all >= 16 for tl.dot."""
    bt, bm_max, warps, stages = _TABLE[capability >= 90]
    bm = min(bm_max, max(16, triton.next_power_of_2(width)))
    bn = max(16, triton.next_power_of_2(n_slots))
    grid = (batch, triton.cdiv(width, bm))
    constexprs = {"BT": bt, "BM": bm, "BN": bn}
    scalars = {"seq_len": "i32", "L": "i32", "M": "i32", "NS": "i32"}
    fwd = {"delta": triton_type(dtype), "slots": "i32", "init": "fp32", "read": "fp32", "final": "fp32"}
    bwd = {"d_read": "fp32", "slots": "i32", "d_final": "fp32", "d_delta": "fp32", "d_init": "fp32"}
    return {
        "fwd": Launch(_phasor_fwd_kernel, fwd, scalars, constexprs, grid, warps, stages),
        "bwd": Launch(_phasor_bwd_kernel, bwd, scalars, constexprs, grid, warps, stages),
    }


class PhasorScanTriton(torch.autograd.Function):
    """Triton forward and backward; saves only the slot ids."""

    @staticmethod
    def forward(ctx, delta, slots, n_slots, init):
        check_triton_inputs(delta, _phasor_fwd_kernel)
        batch, seq_len, levels, width = delta.shape
        delta, slots = delta.contiguous(), slots.to(torch.int32).contiguous()
        init32 = init.float().contiguous()
        read = torch.empty(delta.shape, dtype=torch.float32, device=delta.device)
        final = torch.empty_like(init32)
        launch = phasor_launches(batch, seq_len, levels, width, n_slots, delta.dtype, device_capability(delta))["fwd"]
        launch.run(delta, slots, init32, read, final, seq_len, levels, width, n_slots)
        ctx.save_for_backward(slots)
        ctx.meta = (n_slots, delta.dtype, init.dtype)
        ctx.set_materialize_grads(False)
        return read.to(delta.dtype), final

    @staticmethod
    def backward(ctx, d_read, d_final):
        (slots,) = ctx.saved_tensors
        n_slots, dtype, init_dtype = ctx.meta
        batch, seq_len, levels = slots.shape
        dev = slots.device
        width = d_read.shape[-1] if d_read is not None else d_final.shape[-1]
        g_read = torch.zeros(batch, seq_len, levels, width, device=dev) if d_read is None else d_read.float()
        g_final = torch.zeros(batch, n_slots, width, device=dev) if d_final is None else d_final.float()
        d_delta = torch.empty(batch, seq_len, levels, width, dtype=torch.float32, device=dev)
        d_init = torch.empty(batch, n_slots, width, dtype=torch.float32, device=dev)
        launch = phasor_launches(batch, seq_len, levels, width, n_slots, dtype, device_capability(slots))["bwd"]
        launch.run(g_read.contiguous(), slots, g_final.contiguous(), d_delta, d_init, seq_len, levels, width, n_slots)
        return d_delta.to(dtype), None, None, d_init.to(init_dtype)
