"""A captured piece of GPU work priced: its Triton launches by the launch model (an autotuned call at the
configuration the model predicts fastest), its aten ops by the step model's rules, one after another.

`cost(captured, gpu)` does the work that needs no constant (compiling, counting, sizing) once;
`Costed.seconds(constants)` is then cheap, so a fit can call it many times.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from benchmarks.predict.capture import Captured
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
    configurations of an autotuned kernel."""

    gpu: Gpu
    groups: list[list[LaunchCost]]
    ops: list[Op]

    def seconds(self, c: Constants) -> float:
        """Predicted seconds of the whole work: the device's time, or the host's if it is longer."""
        launches = sum(min(x.seconds(self.gpu, c) for x in group) for group in self.groups)
        device = launches + sum(price_by_kind(self.ops, self.gpu, c.hbm_efficiency, c.launch_seconds).values())
        return max(device, self.host_seconds(c))

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
    return Costed(gpu, list(groups.values()), captured.ops)
