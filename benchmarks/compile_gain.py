"""What compiling the training step buys on the CPU path: kernels launched, elementwise bytes, steps/s.

    python -m benchmarks.compile_gain [--models vort-125m,pmnet-119m] [--tokens 16384] [--mode model]
                                      [--json out.json]

For each model (configs/model/<name>.yaml, fp32, one sequence of --tokens tokens, activation
checkpointing on) it runs a training step (forward, loss, backward, AdamW) eagerly and compiled as
`train.compile: <mode>` compiles it (pretrain/distributed/compiling.py, its inductor settings included),
each in a fresh process of its own, one after the other (nothing of the eager step, of another model or
of an earlier compile is left in the process that compiles; the parent gathers each row), and prints per
step:

- kernels: the ATen kernels the step dispatches (views and allocations, which launch none, left out),
  and, compiled, the kernels inductor generated, as the profiler sees them run. Each scan
  call counts as one (the custom op of kernels/library.py; what the scan launches inside is the same
  both ways), in eager mode too: the scans are called through their ops for the count.
- elementwise bytes: what the memory-bound ops read and write (every dispatched op but the matmuls,
  convolutions, views, allocations and scans: inputs plus outputs); compiled, inductor's estimate of the
  bytes its generated kernels and its fallbacks to such ops access (`--mode model` only: with blocks the
  embedding and loss stay outside the graphs and are not separated here).
- steps/s: one step each (at 16k tokens a CPU step takes minutes, far above the profiler's per-op cost);
  compiled, the step after the first, which compiles; and the CPU seconds of that step (with
  OMP_NUM_THREADS=1, the step's own work, which other jobs on the cores do not inflate).
- the first compiled step's time, compiling included.

Counts and times come from the same step: eager, the first at --tokens; compiled, the second (each
process first runs a short eager step, which has numba compile the CPU scans). The optimizer's foreach
kernels are counted in both columns alike; its bytes, eager in both modes, are added to the compiled
column. --json also keeps each process's peak resident memory (its kernel high-water mark; inductor's
compile workers are processes of their own and not in it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch.utils._python_dispatch import TorchDispatchMode

import kernels._common
from model import build_model
from model.config import load_model_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
aten = torch.ops.aten

MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.addbmm.default,
           aten.convolution.default, aten.convolution_backward.default, aten._convolution.default}
ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
               aten.new_empty.default, aten.new_empty_strided.default, aten.lift_fresh.default}


def _bytes(values: object) -> int:
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (list, tuple)):
        return sum(_bytes(v) for v in values)
    return 0


class _ElementwiseBytes(TorchDispatchMode):
    """The bytes (inputs plus outputs) of the memory-bound ATen ops dispatched in its scope (eager mode:
    under torch.compile a dispatch mode makes dynamo run the frames eagerly); a scan's op is left out,
    with what it dispatches inside."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _memory_bound(func):
            self.total += _bytes(args) + _bytes(list((kwargs or {}).values())) + _bytes(out)
        return out


def _memory_bound(func: torch._ops.OpOverload) -> bool:
    return func.namespace == "aten" and not func.is_view and func not in MATMULS | ALLOCATIONS


NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
             "aten::lift_fresh", "aten::set_", "aten::resize_"}


def _launches(events: list) -> int:
    """Kernels among profiled events: the outermost ATen ops that launch one (not views, allocations or
    no-ops), inductor's generated kernels, and each scan op as one."""

    def kernel_like(name: str) -> bool:
        return name.startswith(("aten::", "recurrent::")) or "cpp_fused" in name

    def is_view(name: str) -> bool:
        packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
        return packet is not None and any(getattr(packet, o).is_view for o in packet.overloads())

    count = 0
    for event in events:
        if not kernel_like(event.name) or event.name in NO_KERNEL or is_view(event.name):
            continue
        parent = event.cpu_parent
        while parent is not None and not kernel_like(parent.name):
            parent = parent.cpu_parent
        count += parent is None
    return count


def _measured(step: Callable[[], None]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, kernels launched) of one step, profiled (the profiler's
    cost is per op: microseconds). With one thread the CPU seconds are the step's work whatever else
    shares the cores; the wall seconds are not, on a shared machine."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start, cpu = time.perf_counter(), time.process_time()
        step()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, cpu, _launches(list(prof.events()))


class _InductorBytes:
    """The bytes inductor's generated kernels and its fallbacks to memory-bound ATen ops read and write,
    over the graphs compiled while it is on (inductor's own per-node estimate, GraphLowering.count_bytes)."""

    def __init__(self) -> None:
        self.total = 0

    def __enter__(self) -> _InductorBytes:
        from torch._inductor.graph import GraphLowering

        self._original = original = GraphLowering.count_bytes

        def count_bytes(graph):
            result = original(graph)
            for node in graph.scheduler.nodes:
                op = getattr(getattr(node, "node", None), "op_overload", None)
                if not node.is_extern() or (isinstance(op, torch._ops.OpOverload) and _memory_bound(op)):
                    self.total += node.get_read_write_buffers_sizes()
            return result

        GraphLowering.count_bytes = count_bytes
        torch._logging.set_logs(inductor_metrics=True)  # what makes inductor call count_bytes
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._inductor.graph import GraphLowering

        GraphLowering.count_bytes = self._original
        torch._logging.set_logs()


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[Callable[[], None], Callable[[], int]]:
    """The training step, and a measure of the bytes its optimizer update moves (eager in every mode)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step() -> None:
        loss, _ = model.loss(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def update_bytes() -> int:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with _ElementwiseBytes() as counted:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return counted.total

    return step, update_bytes


def _model(name: str, tokens: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (training mode, activation checkpointing on) and its --tokens ids, after a short step
    (numba compiles the CPU scans at their first call)."""
    config = load_model_config(CONFIGS / f"{name}.yaml")
    torch.manual_seed(0)
    model = build_model(config).train()
    model.activation_checkpointing = True  # as the configs train: without it 16k tokens take over 20 GB here
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    _step(model, ids[:, :256])[0]()
    return model, ids


def _peak_rss_gb() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def measure_eager(name: str, tokens: int) -> dict:
    """The eager half of a row: one profiled step, each scan called through its op (one kernel)."""
    model, ids = _model(name, tokens)
    step, update_bytes = _step(model, ids)
    # eager through the scans' ops, as compiled: each scan call counts as one kernel
    with kernels._common.scans_as_ops(), _ElementwiseBytes() as eager_bytes:
        seconds, cpu, count = _measured(step)
    return {"kernels_eager": count, "elementwise_gb_eager": eager_bytes.total / 1e9,
            "optimizer_gb": update_bytes() / 1e9, "steps_per_s_eager": 1 / seconds, "cpu_s_eager": cpu,
            "peak_rss_gb_eager": _peak_rss_gb()}


def measure_compiled(name: str, tokens: int, mode: str) -> dict:
    """The compiled half of a row: the first step compiles, the second is profiled."""
    from pretrain.distributed.compiling import DYNAMO_SETTINGS, INDUCTOR_SETTINGS, compile_blocks

    model, ids = _model(name, tokens)
    step, _ = _step(model, ids)
    inductor_config.cpp.enable_kernel_profile = True  # generated kernels show in the profile
    # no graph from the on-disk caches: a cached graph is not lowered again, so its bytes would not be counted
    settings = {"fx_graph_cache": False, "autotune_local_cache": False, **INDUCTOR_SETTINGS}
    with torch._dynamo.config.patch(**DYNAMO_SETTINGS), inductor_config.patch(settings), \
            torch._functorch.config.patch(enable_autograd_cache=False), _InductorBytes() as compiled_bytes:
        if mode == "blocks":
            compile_blocks(model)
        else:
            model.loss = torch.compile(model.loss)
        start = time.perf_counter()
        step()
        first_s = time.perf_counter() - start
        seconds, cpu, kernels = _measured(step)
    return {"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "kernels_compiled": kernels,
            "graph_gb": compiled_bytes.total / 1e9, "steps_per_s_compiled": 1 / seconds,
            "first_compiled_step_s": first_s, "cpu_s_compiled": cpu, "peak_rss_gb_compiled": _peak_rss_gb()}


def _in_child(measure_half: Callable[..., dict], *args: object) -> dict:
    """``measure_half(*args)`` in a fresh process (spawned: it shares nothing with this one)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(measure_half, *args).result()
        except BrokenProcessPool as e:  # the kernel's out-of-memory killer, for one
            raise SystemExit(f"{measure_half.__name__}{args} died before it returned: {e}") from e


def measure(name: str, tokens: int, mode: str) -> dict:
    """One model's row: eager, then compiled as ``mode``, each in its own process."""
    eager = _in_child(measure_eager, name, tokens)
    compiled = _in_child(measure_compiled, name, tokens, mode)
    # the compiled graphs' bytes, each forward and backward graph run once per step (whole model) or once
    # per block; blocks mode leaves the embedding and loss outside, whose bytes this does not separate
    graph_gb, optimizer_gb = compiled.pop("graph_gb"), eager.pop("optimizer_gb")
    compiled_gb = graph_gb + optimizer_gb if mode == "model" else None
    return {"model": name, "tokens": tokens, "mode": mode, **eager, **compiled, "elementwise_gb_compiled": compiled_gb}


def _gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vort-125m,pmnet-119m")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--mode", choices=("blocks", "model"), default="model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print("| model | tokens | compile | kernels/step eager | compiled | elementwise GB eager | compiled | "
          "steps/s eager | compiled | CPU s/step eager | compiled | first compiled step s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    rows = []
    for name in args.models.split(","):  # each row as soon as it is measured: a 125M model's row takes minutes
        r = measure(name, args.tokens, args.mode)
        rows.append(r)
        print(f"| {r['model']} | {r['tokens']:,} | {r['mode']} | {r['kernels_eager']:,} | {r['kernels_compiled']:,} | "
              f"{r['elementwise_gb_eager']:.2f} | {_gb(r['elementwise_gb_compiled'])} | {r['steps_per_s_eager']:.4f} | "
              f"{r['steps_per_s_compiled']:.4f} | {r['cpu_s_eager']:.0f} | {r['cpu_s_compiled']:.0f} | "
              f"{r['first_compiled_step_s']:.0f} |", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
