"""The roofline's "span (before 2026-12-03)" design (benchmarks/roofline.py): the span kernels that the
chunk kernels of 2026-12-03 replaced, priced analytically (they no longer exist; kept as the before)."""

from __future__ import annotations

import torch

from kernels.span import span_chunks

SPAN_SOE_BLOCKS = {"fwd": (32, 64), "bwd": (16, 64)}  # (tokens, value columns) per program, sm_90 table

Costs = dict[str, tuple[float, float]]  # kernel: (FLOPs, bytes) per token and layer


def soe_span_before(sizes: tuple[int, ...], seq_len: int) -> Costs:
    """The replaced span kernels (before 2026-12-03): per (head, term, value block) program, times their
    count; a state tile read or written once per span counts 1/span of its bytes per token; inputs are
    fp32 (4 bytes)."""
    heads, terms, F, D, _chunk = sizes
    (bt_f, bd), (bt_b, _) = SPAN_SOE_BLOCKS["fwd"], SPAN_SOE_BLOCKS["bwd"]
    blocks = -(-D // bd)
    span = bt_f * span_chunks(seq_len, bt_f, heads * terms * blocks)
    state = heads * terms * F * (D + 1) * 4  # one span slot of packed fp32 states
    programs = heads * terms * blocks
    tile = 4 * F * (bd + 1) / span
    loads = 4 * (2 * F + bd + 1)  # q, k, v block, coef
    per_program = {
        "soe_fwd_spans": (2 * F * bd, 4 * (F + bd + 1) + tile),
        "soe_fwd": (2 * bt_f * F + 2 * bt_f * bd + 4 * F * bd, loads + 8 * bd + 8 + tile),
        "soe_bwd_spans": (2 * F * bd, 4 * (F + bd + 1) + tile),
        "soe_bwd_forward_order": (2 * bt_b * (3 * F + 2 * bd) + 4 * F * bd, loads + 4 * bd + 4 + 16 * F + 8 * bd + 8
                                  + tile),
        "soe_bwd_reverse_order": (6 * F * bd, loads + 4 * bd + 4 + 8 * F + 8 * bd + 8 + tile),
    }
    out = {k: (programs * f, programs * b) for k, (f, b) in per_program.items()}
    return out | {"soe_fwd_pass": (0.0, 2 * state / span), "soe_bwd_pass": (0.0, 2 * state / span)}


def phasor_span_before(sizes: tuple[int, ...], seq_len: int) -> Costs:
    """The phasor kernels of phasor_launches for fp32 increments with fp32 IEEE dots (before
    2026-12-03): one-hot products over the padded slot block; the phases of all slots read or written
    once per span count 1/span of their bytes."""
    from kernels.phasor.triton import phasor_launches

    levels, width, n_slots = sizes
    span, launches = phasor_launches(1, seq_len, levels, width, n_slots, torch.float32, 90)
    state = n_slots * width * 4 / span
    out = {}
    for name, launch in launches.items():
        if name.endswith("_pass"):
            out[f"phasor_{name}"] = (0.0, 2 * state)
            continue
        bt, bm, bn = (launch.constexprs[k] for k in ("BT", "BM", "BN"))
        blocks = launch.grid[1]
        rows = levels * (width * 4 + 4 * blocks)  # a row in, a slot id per program
        if name.endswith("_spans"):
            out[f"phasor_{name}"] = (levels * blocks * 2 * bn * bm, rows + state)
        else:  # read from the state, same-slot sums, state update; a row out, the entering phases
            out[f"phasor_{name}"] = (levels * blocks * (4 * bn * bm + 2 * bt * bm), rows + levels * width * 4 + state)
    return out
