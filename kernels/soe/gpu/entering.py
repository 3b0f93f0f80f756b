"""The entering-state read of sequence parallelism in Triton: o_t = sum_s lam_s^(t+1) q_t^T G_s and
z_t likewise with b_s, for a state (G, b) entering a piece, with its backward. No atomics: the gradient
of the state comes from the scan's reverse span walk and span pass (kernels/soe/gpu/forward.py,
span_states_kernel), those of q and log_lam from per-value-block partials summed in a fixed order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import Launch, check_triton_inputs, device_capability, triton_type
from kernels.soe.gpu.function import pack, pass_sizes, slots, unpack
from kernels.soe.gpu.launches import chunk_block, precision, soe_launches, walk_span
from kernels.soe.gpu.tiles import (
    chunk_program,
    first_block,
    load_rows,
    state_offsets,
    state_row,
    store_rows,
    token_rows,
)


@triton.jit
def entering_fwd_kernel(
    q, log_lam, states, out, z, seq_len, BH, H, S, F, DV, W,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """o and z of one chunk and value block, the S terms folded in, from the packed entering state
    (slot 0 of ``states``). Plain stores (z by the first value block)."""
    _c, bh, b, h, start = chunk_program(BH, H, BT)
    base, loc, mask_t = token_rows(b, h, start, seq_len, H, BT)
    offs_f, offs_d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    qc = load_rows(q, base, loc, F, offs_f, mask_t)
    qf = qc.to(tl.float32)
    steps = (start + tl.arange(0, BT) + 1).to(tl.float32)
    o = tl.zeros([BT, BD], dtype=tl.float32)
    zc = tl.zeros([BT], dtype=tl.float32)
    for s in range(0, S):
        qd = qf * tl.exp(steps * tl.load(log_lam + h * S + s))[:, None]
        row = state_row(states, 0, bh, s, BH, S, W)
        g = tl.load(row + tile, mask=tile_mask, other=0.0)
        o += tl.dot(qd.to(qc.dtype), g.to(qc.dtype), input_precision=PRECISION)
        zc += tl.sum(qd * tl.load(row + norm_off, mask=norm_mask, other=0.0)[None, :], axis=1)
    store_rows(out, base, loc, DV, offs_d, mask_t, o)
    tl.store(z + base + loc, zc, mask=mask_t & first_block(BT))


@triton.jit
def entering_bwd_kernel(
    q, log_lam, states, d_out, d_z, dq, dll, seq_len, BH, H, S, F, DV, W,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """This value block's partial query gradient (rows of [NV * B*T*H, F]) and d log_lam ([NV, n_chunks *
    B*H, S]; lam^(t+1) gives sum_t (t + 1) lam^(t+1) q_t . d(qd)_t) of one chunk."""
    c, bh, b, h, start = chunk_program(BH, H, BT)
    base, loc, mask_t = token_rows(b, h, start, seq_len, H, BT)
    offs_f, offs_d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    qf = load_rows(q, base, loc, F, offs_f, mask_t).to(tl.float32)
    doc = load_rows(d_out, base, loc, DV, offs_d, mask_t)
    dzc = tl.load(d_z + base + loc, mask=mask_t & first_block(BT), other=0.0)
    steps = (start + tl.arange(0, BT) + 1).to(tl.float32)
    part = tl.program_id(1).to(tl.int64)
    dq_acc = tl.zeros([BT, BF], dtype=tl.float32)
    for s in range(0, S):
        scale = tl.exp(steps * tl.load(log_lam + h * S + s))
        row = state_row(states, 0, bh, s, BH, S, W)
        g = tl.load(row + tile, mask=tile_mask, other=0.0).to(doc.dtype)
        norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
        d_qd = tl.dot(doc, tl.trans(g), input_precision=PRECISION) + dzc[:, None] * norm[None, :]
        dq_acc += d_qd * scale[:, None]
        ll_s = tl.sum(tl.sum(qf * d_qd, axis=1) * scale * steps, axis=0)
        tl.store(dll + ((part * tl.num_programs(0) + c * BH + bh) * S + s), ll_s)
    store_rows(dq, base + part * seq_len * BH, loc, F, offs_f, mask_t, dq_acc)


# Per target (sm_90 or newer) and kernel: (largest value block, warps, stages).
_TABLE: dict[bool, dict[str, tuple[int, int, int]]] = {
    False: {"fwd": (64, 4, 2), "bwd": (64, 4, 2)},
    True: {"fwd": (64, 8, 2), "bwd": (64, 8, 2)},
}
ENTERING_CHUNK = 64
INTS = ("seq_len", "BH", "H", "S", "F", "DV", "W")


def entering_launches(
    batch: int, seq_len: int, heads: int, n_terms: int, feat: int, width: int, dtype: torch.dtype, capability: int
) -> dict[str, Launch]:
    """The launches of the entering-state read, in the order they run: "fwd" (o, z); backward
    "bwd_states" and "bwd_pass" (the state's gradient: the scan's own reverse span walk and span pass,
    kernels/soe/gpu/launches.py) and "bwd" (the q and log_lam partials). The chunk kernels run one
    program per (chunk x batch x head, value block)."""
    cap = capability >= 90
    bt = chunk_block(ENTERING_CHUNK, capability)
    bf = max(16, triton.next_power_of_2(feat))
    operand = triton_type(dtype)
    made = {
        "fwd": (entering_fwd_kernel, {"q": operand, "log_lam": "fp32", "states": "fp32", "out": "fp32", "z": "fp32"}),
        "bwd": (entering_bwd_kernel, {"q": operand, "log_lam": "fp32", "states": "fp32", "d_out": operand}
                | dict.fromkeys(("d_z", "dq", "dll"), "fp32")),
    }  # fmt: skip
    launches = {}
    for name, (kernel, pointers) in made.items():
        largest, warps, stages = _TABLE[cap][name]
        bd = min(largest, max(16, triton.next_power_of_2(width)))
        constexprs = {"BT": bt, "BF": bf, "BD": bd, "PRECISION": precision(dtype)}
        grid = (triton.cdiv(seq_len, bt) * batch * heads, triton.cdiv(width, bd), 1)
        launches[name] = Launch(kernel, pointers, dict.fromkeys(INTS, "i32"), constexprs, grid, warps, stages,
                                wide=frozenset(pointers) - {"log_lam"})  # fmt: skip
    scan = soe_launches(batch, seq_len, heads, n_terms, feat, width, ENTERING_CHUNK, dtype, capability)[1]
    return {"fwd": launches["fwd"], "bwd_states": scan["bwd_states"], "bwd_pass": scan["bwd_pass"],
            "bwd": launches["bwd"]}  # fmt: skip


class SoeEnteringTriton(torch.autograd.Function):
    """The (o, z) contributions of a state entering a piece: o_t = sum_s lam_s^(t+1) q_t^T G_s, z_t likewise
    with b_s; the Triton form of kernels.parallel's entering-state correction. Saves only the inputs
    (``prepare_backward``)."""

    @staticmethod
    def forward(ctx, q, log_lam, g_in, b_in):
        batch, seq_len, heads, feat = q.shape
        n_terms, width = log_lam.shape[-1], g_in.shape[-1]
        check_triton_inputs(q, entering_fwd_kernel)
        q, ll, state = SoeEnteringTriton.prepare_backward(ctx, q, log_lam, g_in, b_in)
        out = torch.empty(batch, seq_len, heads, width, dtype=torch.float32, device=q.device)
        z = torch.empty(batch, seq_len, heads, dtype=torch.float32, device=q.device)
        launch = entering_launches(batch, seq_len, heads, n_terms, feat, width, q.dtype, device_capability(q))["fwd"]
        launch.run(q, ll, state, out, z, seq_len, batch * heads, heads, n_terms, feat, width, state.shape[-1])
        return out.to(g_in.dtype), z.to(g_in.dtype)

    @staticmethod
    def prepare_backward(ctx, q, log_lam, g_in, b_in) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Save what the backward reads, the inputs as the kernels take them (q, fp32 log_lam, the packed
        state), and return them: the forward's first half, all a backward run apart from it needs (the
        torch.library op's backward, kernels/library.py)."""
        q, ll, state = q.contiguous(), log_lam.float().contiguous(), pack(g_in, b_in)[None]
        ctx.save_for_backward(q, ll, state)
        ctx.meta = ((q.dtype, log_lam.dtype, g_in.dtype, b_in.dtype), g_in.shape)
        ctx.set_materialize_grads(False)
        return q, ll, state

    @staticmethod
    def backward(ctx, d_o, d_z):
        q, ll, state = ctx.saved_tensors
        dtypes, g_shape = ctx.meta
        batch, seq_len, heads, feat = q.shape
        n_terms, width = ll.shape[-1], g_shape[-1]
        dev, f32 = q.device, torch.float32
        d_out = torch.zeros((*q.shape[:3], width), dtype=q.dtype, device=dev) if d_o is None else d_o.to(q.dtype)
        d_zz = torch.zeros(q.shape[:3], dtype=f32, device=dev) if d_z is None else d_z.to(f32)
        d_out, d_zz = d_out.contiguous(), d_zz.contiguous()
        capability = device_capability(q)
        launches = entering_launches(batch, seq_len, heads, n_terms, feat, width, q.dtype, capability)
        chunk = launches["fwd"].constexprs["BT"]
        span = walk_span(batch, seq_len, heads, n_terms, feat, width, chunk, capability)
        n_spans, n_chunks = triton.cdiv(seq_len, span * chunk), triton.cdiv(seq_len, chunk)
        sizes = (seq_len, batch * heads, heads, n_terms, feat, width, state.shape[-1])
        docs = torch.zeros(batch, seq_len, dtype=torch.int32, device=dev)  # no resets inside the read
        d_states = slots(n_spans, torch.zeros_like(state[0]), at_end=True)
        launches["bwd_states"].run(q, d_out, d_zz, ll, docs, d_states, *sizes, span)
        carry = torch.ones(batch, n_spans, dtype=f32, device=dev)
        launches["bwd_pass"].run(d_states, ll, carry, n_spans, seq_len, span * chunk,
                                 *pass_sizes(d_states, heads * n_terms))  # fmt: skip
        n_blocks = launches["bwd"].grid[1]
        dq = torch.empty(n_blocks, *q.shape, dtype=f32, device=dev)
        dll = torch.empty(n_blocks * n_chunks * batch, heads, n_terms, dtype=f32, device=dev)
        launches["bwd"].run(q, ll, state, d_out, d_zz, dq, dll, *sizes)
        dg, db = unpack(d_states[0], g_shape)
        return tuple(x.to(d) for x, d in zip((dq.sum(0), dll.sum(0), dg, db), dtypes))
