"""Checks of the launch model that compile real kernels, run in a fresh process by tests/test_predict.py
(other test modules turn on TRITON_INTERPRET=1, under which triton cannot compile). Prints one JSON
object of measured facts; the test asserts on them."""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def chunk_loop(a_ptr, b_ptr, c_ptr, n_chunks, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[pid] = sum over n_chunks of A_chunk @ B: a loop whose trip count is an argument."""
    pid = tl.program_id(0)
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(n_chunks):
        a = tl.load(a_ptr + (pid * n_chunks + i) * BM * BK + rm[:, None] * BK + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + pid * BM * BN + rm[:, None] * BN + rn[None, :], acc)


@triton.jit
def triangle(x_ptr, n, BLOCK: tl.constexpr):
    """An inner loop whose bound is the outer loop's variable: n (n - 1) / 2 inner iterations."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(n):
        for j in range(i):
            acc += tl.load(x_ptr + j * BLOCK + offs)
    tl.store(x_ptr + offs, acc)


def work(kernel, grid, args, warps, target, options=()):
    from benchmarks.predict.capture import Launch
    from benchmarks.predict.gpu import H100
    from benchmarks.predict.launch_model import launch_cost, occupancy
    from benchmarks.predict.sass import compile_launch, loop_trips, program_work

    values = dict(zip(kernel.arg_names, args))
    launch = Launch(kernel, values, grid, warps, 2, 1, options)
    binary = compile_launch(launch, target)
    trips = loop_trips(binary, launch)
    prog = program_work(binary, trips)
    out = {"flops": prog.tensor_flops, "trips": trips, "nest": binary.nest.mean_trips(values, grid, 16),
           "loops": binary.loops, "registers": binary.registers, "shared": binary.shared,
           "occupancy": occupancy(binary, H100), "wgmma": any(i.opcode == "HGMMA" for i in binary.instructions),
           "hmma": any(i.opcode == "HMMA" for i in binary.instructions), "loads": prog.per_warp.get("global", 0),
           "spills": binary.spills, "local": prog.per_warp.get("local", 0)}
    if target == 90:
        cost = launch_cost(launch, H100)
        out["hbm_bytes"], out["l2_bytes"] = cost.hbm_bytes, cost.l2_bytes
        out["tensor_bytes"] = sum(t.numel() * t.element_size() for t in values.values() if isinstance(t, torch.Tensor))
    return out


def main() -> None:
    meta = {"device": "meta"}
    facts = {}
    for target, bm, warps in ((90, 64, 4), (80, 64, 4), (90, 16, 1)):
        for n in (3, 12):
            a = torch.empty(8 * n * bm * 32, dtype=torch.bfloat16, **meta)
            b = torch.empty(32 * 64, dtype=torch.bfloat16, **meta)
            c = torch.empty(8 * bm * 64, dtype=torch.float32, **meta)
            facts[f"dot sm{target} BM{bm} n{n}"] = work(chunk_loop, (8, 1, 1), (a, b, c, n, bm, 64, 32), warps, target)
    # two programs over tensors sized for eight: the launch touches a quarter of A and C (as one phase of a
    # long sequence does), which its loads and stores request in all
    a = torch.empty(8 * 3 * 64 * 32, dtype=torch.bfloat16, **meta)
    b = torch.empty(32 * 64, dtype=torch.bfloat16, **meta)
    c = torch.empty(8 * 64 * 64, dtype=torch.float32, **meta)
    facts["dot sm90 part"] = work(chunk_loop, (2, 1, 1), (a, b, c, 3, 64, 64, 32), 4, 90)
    # capped at 32 registers a thread, the [64, 64] fp32 accumulator alone (32 a thread at 4 warps) spills
    facts["dot sm80 capped"] = work(chunk_loop, (8, 1, 1), (a, b, c, n, 64, 64, 32), 4, 80, (("maxnreg", 32),))
    x = torch.empty(64 * 128, dtype=torch.float32, **meta)
    for n in (20, 40):
        facts[f"triangle n{n}"] = work(triangle, (4, 1, 1), (x, n, 128), 4, 90)
    json.dump(facts, sys.stdout)


if __name__ == "__main__":
    main()
