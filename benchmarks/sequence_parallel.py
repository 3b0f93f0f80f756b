"""What sequence parallelism costs a scan: the local scan, the entering-state correction, the exchange.

    python -m benchmarks.sequence_parallel [--T 8192,32768] [--ranks 2] [--ops soe,phasor,memory]

Spawns ``--ranks`` gloo ranks on this machine; each holds T/ranks tokens of one sequence. Per op and
length it prints, for rank 1 (which has an entering state): the forward+backward time of the local
scan alone, of the whole sequence-parallel scan, of the correction pass alone and of the state
all-gather (and its reduce-scatter backward) alone, the ratio sequence-parallel / local (target <= 1.3),
and the bytes each rank sends per call. The memory op compares, for PMNet's memory scan, the parallel
combine (kernels.phasor_scan_sequence_parallel, what the model runs) with the relay it replaced (rank r
waits for rank r-1's final phases, scans from them and sends its own on; the backward runs the chain in
reverse): the slowest rank's forward+backward wall time here (the one a step waits for), and the
critical path on as many cores as ranks, from each rank's compute alone (its thread's CPU time): the
slowest rank's for the combine, every rank's added up for the relay, whose ranks work one after
another. On a machine with fewer usable cores than ranks the wall times cannot show the relay's
serial chain (the ranks share the cores either way); the critical path can. Times are the best of
``--repeats``. Shapes are VORT-125m's per layer (H 12, F 64, D 64) and PMNet's memory (4
levels, M 64); the SOE terms are the decay bank of the VORT config given by --decays (how far into a
piece each term still reads the entering state decides the correction's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.parallel import (
    _gather_states,
    _SoeStateCorrection,
    phasor_scan_sequence_parallel,
    soe_scan_sequence_parallel,
)
from kernels.phasor import phasor_scan
from kernels.soe import soe_scan
from kernels.testing import phasor_inputs, soe_inputs


def _best(fn: Callable[[], torch.Tensor], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def _fwd_bwd(run: Callable[[], list[torch.Tensor]]) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        outs = run()
        loss = sum(o.float().sum() for o in outs if o is not None and o.requires_grad)
        loss.backward()
        return loss

    return call


def vort_decays(config: str, heads: int) -> torch.Tensor:
    """The log decays [heads, S] that a VORT layer of this config passes to the scan."""
    from model.vort_memory import VariableOrderMemory
    from pretrain.config import load_config

    return VariableOrderMemory(load_config(config, []).model).log_lambda.float().expand(heads, -1).contiguous()


def _soe_row(T: int, args: argparse.Namespace) -> dict:
    n_terms = args.log_lam.shape[-1]
    x = soe_inputs(1, T, args.heads, args.feat, args.dim, n_terms, with_state=False, seed=0)
    x["log_lam"] = args.log_lam
    leaves = {n: t.float().requires_grad_(n != "log_lam") for n, t in x.items()}  # VORT's decays are buffers
    q, k, v, coef, log_lam = (leaves[n] for n in ("q", "k", "v", "coef", "log_lam"))
    g = torch.zeros(1, args.heads, n_terms, args.feat, args.dim, requires_grad=True)
    b = torch.zeros(1, args.heads, n_terms, args.feat, requires_grad=True)
    local = _fwd_bwd(lambda: list(soe_scan(q, k, v, coef, log_lam, None, False, args.chunk)[:2]))
    parallel = _fwd_bwd(lambda: list(soe_scan_sequence_parallel(q, k, v, coef, log_lam, None, None, False,
                                                                args.chunk)[:2]))
    correction = _fwd_bwd(lambda: list(_SoeStateCorrection.apply(q, log_lam, g, b, args.chunk)))
    gather = _fwd_bwd(lambda: [_gather_states(g, None), _gather_states(b, None)])
    state_bytes = (g.numel() + b.numel()) * 4
    return {"op": "soe", "T_rank": T, "local_s": _best(local, args.repeats),
            "parallel_s": _best(parallel, args.repeats), "correction_s": _best(correction, args.repeats),
            "exchange_s": _best(gather, args.repeats),
            "bytes_sent": 2 * state_bytes * (dist.get_world_size() - 1)}


def _phasor_row(T: int, args: argparse.Namespace) -> dict:
    x, n_slots = phasor_inputs(1, T, 4, 64, 4, with_state=False, seed=0)
    delta = x["delta"].float().requires_grad_()
    slots = x["slots"]
    init = torch.zeros(1, n_slots, 64, requires_grad=True)
    local = _fwd_bwd(lambda: [phasor_scan(delta, slots, n_slots)[0]])
    parallel = _fwd_bwd(lambda: [phasor_scan_sequence_parallel(delta, slots, n_slots)[0]])
    entering = init.gather(1, slots.reshape(1, -1, 1).expand(-1, -1, 64))
    correction = _fwd_bwd(lambda: [init.gather(1, slots.reshape(1, -1, 1).expand(-1, -1, 64)) + entering.detach()])
    gather = _fwd_bwd(lambda: [_gather_states(init, None)])
    return {"op": "phasor", "T_rank": T, "local_s": _best(local, args.repeats),
            "parallel_s": _best(parallel, args.repeats), "correction_s": _best(correction, args.repeats),
            "exchange_s": _best(gather, args.repeats), "bytes_sent": 2 * init.numel() * 4 * (dist.get_world_size() - 1)}


def _peer(group: dist.ProcessGroup | None, step: int) -> int | None:
    """The global rank of the group member `step` places after this one (None past either end)."""
    rank = dist.get_rank(group) + step
    if not 0 <= rank < dist.get_world_size(group):
        return None
    return dist.get_global_rank(group, rank) if group is not None else rank


def _swap(send: torch.Tensor | None, send_to: int | None, receive: torch.Tensor, receive_from: int | None) -> None:
    """Post the send and the receive together, then wait for both (no ordering deadlock)."""
    requests = []
    if send_to is not None:
        requests.append(dist.isend(send.contiguous(), send_to))
    if receive_from is not None:
        requests.append(dist.irecv(receive, receive_from))
    for request in requests:
        request.wait()


class _Receive(torch.autograd.Function):
    """The relay's receive (PMNet's memory before the parallel combine): the previous rank's final
    phases; backward sends their gradient back. ``carrier`` makes autograd run the backward."""

    @staticmethod
    def forward(ctx, like, carrier):
        ctx.like = like.detach()
        received = torch.zeros_like(like)
        _swap(None, None, received, _peer(None, -1))
        return carrier.view_as(carrier), received

    @staticmethod
    def backward(ctx, grad_carrier, grad_received):
        outgoing = torch.zeros_like(ctx.like) if grad_received is None else grad_received
        if _peer(None, -1) is not None:
            _swap(outgoing, _peer(None, -1), outgoing, None)
        return None, grad_carrier


class _Send(torch.autograd.Function):
    """The relay's send: this rank's final phases to the next rank; backward receives their gradient."""

    @staticmethod
    def forward(ctx, x, carrier):
        ctx.like = x.detach()
        _swap(x, _peer(None, 1), x, None)
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad_carrier):
        from_next = torch.zeros_like(ctx.like)
        _swap(None, None, from_next, _peer(None, 1))
        return from_next, grad_carrier


def _over_ranks(seconds: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX) -> float:
    """Every rank's time reduced by ``op``: MAX, the slowest rank (a step waits for it); SUM, all of them."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t)


def _memory_row(T: int, args: argparse.Namespace) -> dict:
    x, n_slots = phasor_inputs(1, T, 4, 64, 4, with_state=False, seed=dist.get_rank())
    delta = x["delta"].float().requires_grad_()
    slots = x["slots"]
    zeros = torch.zeros(1, n_slots, 64)

    def relay() -> list[torch.Tensor]:
        carrier, received = _Receive.apply(zeros, delta)
        entering = received if dist.get_rank() > 0 else zeros
        read, final = phasor_scan(carrier, slots, n_slots, entering, True)
        return [_Send.apply(final, read)]

    local = _fwd_bwd(lambda: [phasor_scan(delta, slots, n_slots)[0]])
    combine = _fwd_bwd(lambda: [phasor_scan_sequence_parallel(delta, slots, n_slots)[0]])
    relay = _fwd_bwd(relay)
    times = {name: _over_ranks(_best(fn, args.repeats)) for name, fn in
             (("local_s", local), ("combine_s", combine), ("relay_s", relay))}
    # Compute alone (this thread's CPU time, waits excluded): the combine's ranks work side by side, so its
    # critical path is the slowest rank's; the relay's ranks work one after another, forward then backward
    # in reverse, so its critical path is the sum of every rank's (the messages, B x n_slots x M phases,
    # left out of both).
    times["combine_cpu_s"] = _over_ranks(_best(combine, args.repeats, time.thread_time))
    times["relay_cpu_s"] = _over_ranks(_best(relay, args.repeats, time.thread_time), dist.ReduceOp.SUM)
    return {"op": "memory", "T_rank": T, **times}


ROWS = {"soe": _soe_row, "phasor": _phasor_row, "memory": _memory_row}


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        rows = [ROWS[op](T // args.ranks, args) for T in args.T for op in args.ops]
        if rank == 1:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=lambda s: [int(t) for t in s.split(",")], default=[8192, 32768])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(ROWS), help="of soe, phasor, memory")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--feat", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--decays", default="configs/vort-125m-128k.yaml", help="VORT config whose decay bank to use")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.ranks < 2 or set(args.ops) - set(ROWS):
        parser.error(f"--ranks must be >= 2 and --ops a list of {', '.join(ROWS)}; got {args.ranks}, {args.ops}")
    args.log_lam = vort_decays(args.decays, args.heads)
    from tests.launchers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_worker, args=(free_port(), args, out), nprocs=args.ranks)
        rows = json.loads(Path(out).read_text())
    scans = [r for r in rows if r["op"] != "memory"]
    if scans:
        print(f"{'op':<8}{'T/rank':>8}{'local s':>10}{'SP s':>10}{'SP/local':>10}{'correct s':>11}{'exchange s':>12}"
              f"{'bytes sent':>12}")
    for r in scans:
        print(f"{r['op']:<8}{r['T_rank']:>8}{r['local_s']:>10.4f}{r['parallel_s']:>10.4f}"
              f"{r['parallel_s'] / r['local_s']:>10.2f}{r['correction_s']:>11.4f}{r['exchange_s']:>12.4f}"
              f"{r['bytes_sent']:>12,}")
    memory = [r for r in rows if r["op"] == "memory"]
    if memory:
        print(f"PMNet memory over {args.ranks} ranks ({os.cpu_count()} CPUs here, "
              f"{len(os.sched_getaffinity(0))} usable); wall: slowest rank here; critical path: compute alone")
        print(f"{'T/rank':>8}{'local s':>10}{'combine s':>11}{'relay s':>10}{'path: combine s':>17}"
              f"{'path: relay s':>15}{'relay/combine':>15}")
    for r in memory:
        print(f"{r['T_rank']:>8}{r['local_s']:>10.4f}{r['combine_s']:>11.4f}{r['relay_s']:>10.4f}"
              f"{r['combine_cpu_s']:>17.4f}{r['relay_cpu_s']:>15.4f}{r['relay_cpu_s'] / r['combine_cpu_s']:>15.2f}")
    return rows


if __name__ == "__main__":
    main()
