"""A captured piece of GPU work priced: its Triton launches by the launch model (an autotuned call at the
configuration the model predicts fastest), its aten ops by the step model's rules, one after another.

`cost(captured, gpu)` does the work that needs no constant (compiling, counting, sizing) once;
`Costed.seconds(constants)` is then cheap, so a fit can call it many times.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from benchmarks.predict.capture import Captured, Launch
from benchmarks.predict.gpu import Gpu
from benchmarks.predict.launch_model import Constants, LaunchCost, launch_cost
from benchmarks.predict.ops import Op
from benchmarks.predict.step import price_by_kind

ATEN_HOST_SECONDS = 5e-6
"""Host time to issue one eager aten op that launches a kernel. PyTorch's operator micro-benchmark
measures 3.3-3.4 us per call for `split` on CUDA, an op that launches nothing (pytorch/pytorch pull
request 32194); an op with a kernel adds the CUDA launch itself, about 2 us."""


@dataclasses.dataclass
class Row:
    """One line of a priced breakdown."""

    name: str
    config: str
    seconds: float
    alternatives: int = 1


@dataclasses.dataclass
class Costed:
    """Captured work with its launches costed: each group is one call, its alternatives the
    configurations of an autotuned kernel. ``launches`` are the captured launches themselves (their
    places among the ops, for `fused_memory`)."""

    gpu: Gpu
    groups: list[list[LaunchCost]]
    ops: list[Op]
    launches: list[Launch] = dataclasses.field(default_factory=list)

    def compiled_seconds(self, c: Constants) -> float:
        """Predicted seconds as torch.compile would run it (`fused_memory` for the memory ops)."""
        others = [op for op in self.ops if op.kind in ("gemm", "attention")]
        kinds = price_by_kind(others, self.gpu, c.hbm_efficiency, c.launch_seconds)
        moved, kernels = fused_memory(self.ops, self.launches)
        memory = moved / (self.gpu.hbm_bytes_per_s * c.hbm_efficiency) + kernels * c.launch_seconds
        host = len(self.groups) * c.host_seconds_per_launch + (kernels + len(others)) * ATEN_HOST_SECONDS
        return max(self.launch_seconds(c) + sum(kinds.values()) + memory, host)

    def seconds(self, c: Constants) -> float:
        """Predicted seconds of the whole work: the device's time, or the host's if it is longer."""
        ops = price_by_kind(self.ops, self.gpu, c.hbm_efficiency, c.launch_seconds)
        return max(self.launch_seconds(c) + sum(ops.values()), self.host_seconds(c))

    def launch_seconds(self, c: Constants) -> float:
        """The Triton launches' device time, each autotuned call at its fastest configuration."""
        return sum(min(x.seconds(self.gpu, c) for x in group) for group in self.groups)

    def host_seconds(self, c: Constants) -> float:
        """The host's time to issue every launch and aten op (views and allocations launch nothing)."""
        ops = sum(1 for op in self.ops if op.kind != "view")
        return len(self.groups) * c.host_seconds_per_launch + ops * ATEN_HOST_SECONDS

    def breakdown(self, c: Constants) -> list[Row]:
        """Per launch, the configuration picked and its time; then the aten ops by kind."""
        rows = []
        for group in self.groups:
            best = min(group, key=lambda x: x.seconds(self.gpu, c))
            rows.append(Row(best.name, best.config + (" wgmma" if best.wgmma else ""), best.seconds(self.gpu, c),
                            len(group)))
        for kind, s in price_by_kind(self.ops, self.gpu, c.hbm_efficiency, c.launch_seconds).items():
            count = sum(1 for op in self.ops if op.kind == kind)
            if s or count:
                rows.append(Row(f"aten {kind}", f"{count} ops", s))
        rows.append(Row("host (issue all)", "the step's time if above the device's", self.host_seconds(c)))
        return rows


def cost(captured: Captured, gpu: Gpu) -> Costed:
    """Compile and count every launch of ``captured`` for ``gpu``."""
    groups: OrderedDict[int, list[LaunchCost]] = OrderedDict()
    for launch in captured.launches:
        groups.setdefault(launch.group, []).append(launch_cost(launch, gpu))
    return Costed(gpu, list(groups.values()), captured.ops, captured.launches)


def fused_memory(ops: list[Op], launches: list[Launch]) -> tuple[float, int]:
    """(bytes, kernels) of the memory ops when fused as torch.compile's inductor fuses them, to first order: a run of
    memory ops with no GEMM, attention op or Triton launch between them is fused; the fused code reads each
    storage it did not itself produce once, and writes each storage it changed that anything after it reads or
    that it did not create (a parameter, gradient or optimizer state updated in place); what it creates and
    nothing reads is never written. Each distinct output size in a run (a reduction's, a pointwise op's) is one
    kernel. Views and allocations move nothing. A first-order model of inductor, not inductor: it fuses across
    every pointwise/reduction boundary inductor would and no further."""
    barriers = {launch.position for launch in launches if launch.position >= 0}
    last_read: dict[int, int] = {}
    for i, op in enumerate(ops):
        for key, _size in op.reads:
            last_read[key] = i
    for launch in launches:
        for key in launch.touches:
            last_read[key] = max(last_read.get(key, -1), launch.position)
    created: dict[int, int] = {}  # storage -> the op that made it (its first sight, as a new output)
    seen: set[int] = set()
    for i, op in enumerate(ops):
        inputs = {key for key, _size in op.reads}
        for key in inputs | {key for key, _size in op.writes}:
            if key not in seen and key not in inputs:
                created[key] = i
            seen.add(key)
    moved, kernels, region = 0.0, 0, []

    def close(end: int) -> None:
        nonlocal moved, kernels
        if not region:
            return
        start, produced, read, written, sizes = region[0], set(), {}, {}, set()
        for i in region:
            op = ops[i]
            for key, size in op.reads:
                if key not in produced:
                    read.setdefault(key, size)
            for key, size in op.writes:
                produced.add(key)
                if last_read.get(key, -1) >= end or not start <= created.get(key, -1) < end:
                    written[key] = max(size, written.get(key, 0))
                sizes.add(size)
        moved += sum(read.values()) + sum(written.values())
        kernels += len(sizes)
        region.clear()

    for i, op in enumerate(ops):
        if i in barriers or op.kind in ("gemm", "attention"):
            close(i)
        if op.kind == "memory":
            region.append(i)
    close(len(ops))
    return moved, kernels
