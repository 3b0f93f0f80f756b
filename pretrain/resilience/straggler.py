"""The straggler report: at each log step, every rank's time per step split into data wait,
communication wait and the rest, and the name of a rank that holds the others up.

In synchronous data-parallel training every rank's step takes the same wall time: a slow rank's delay
is spent by the others waiting in the next collective. So a straggler shows not in step time but in
how that time divides: it computes (or reads data, or is descheduled) while the others wait for it.
Each rank therefore measures, with no host sync:

- data wait: wall time in the loop's data phase (reading, packing, the copy to the device);
- communication wait: a thread samples the main thread's innermost Python frame every SAMPLE_S and
  counts the time since the previous sample as communication when that frame is a torch.distributed
  collective (COLLECTIVE_FILES): every collective DeepSpeed, FSDP2 and the trainer make on CPU waits
  there. Collectives run on the device (NCCL) do not block the host, so on GPUs this part reads
  near zero and the device's waits stay in "the rest";
- the rest: the step's wall time minus both.

At a log step one host all-reduce shares the window's per-step means. A rank whose time outside
communication (data wait plus the rest) exceeds `train.straggler_factor` times the lower median of all
ranks' (with 2 ranks, the faster one's) is named on the console and in metrics.jsonl
(`perf/straggler_rank`, -1 when none is, and `perf/straggler_slowdown`, the slowest rank's ratio),
beside every rank's three times (`perf/rank_data_s`, `perf/rank_comm_s`, `perf/rank_other_s`,
lists by rank). Steps that do not log add only clock reads.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch

from pretrain.distributed.process_group import all_reduce_sum

SAMPLE_S = 0.01
COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py")
"""Where a rank waits for its peers: the innermost frame of the main thread during a collective."""


class CommSampler:
    """A thread that accumulates the time the main thread spends inside collectives (sampled)."""

    def __init__(self) -> None:
        self.main = threading.get_ident()
        self.comm_s = 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="comm-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        last = time.monotonic()
        while not self._stopped.wait(SAMPLE_S):
            now = time.monotonic()
            frame = sys._current_frames().get(self.main)
            if frame is not None and frame.f_code.co_filename.endswith(COLLECTIVE_FILES):
                self.comm_s += now - last
            last = now

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class StepTimes:
    """This rank's data wait, communication wait and step time summed over the steps since the last
    report; the loop marks each step's start, the end of its data phase and its end."""

    def __init__(self, world: int) -> None:
        self.sampler = CommSampler() if world > 1 else None
        self.data_s = self.step_s = 0.0
        self.steps = 0
        self._comm_at_report = 0.0
        self._started = self._data_done = 0.0

    def step_begins(self) -> None:
        self._started = time.perf_counter()

    def data_ready(self) -> None:
        self._data_done = time.perf_counter()
        self.data_s += self._data_done - self._started

    def step_ends(self) -> None:
        self.step_s += time.perf_counter() - self._started
        self.steps += 1

    def take(self) -> tuple[float, float, float]:
        """(data, communication, rest) seconds per step since the last call, and start a new window."""
        comm_total = self.sampler.comm_s if self.sampler else 0.0
        comm, self._comm_at_report = comm_total - self._comm_at_report, comm_total
        steps = max(self.steps, 1)
        data, step = self.data_s / steps, self.step_s / steps
        self.data_s = self.step_s = 0.0
        self.steps = 0
        comm = min(comm / steps, step - data)
        return data, comm, step - data - comm

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


def report(times: StepTimes, rank: int, world: int, factor: float) -> tuple[dict[str, float], dict[str, torch.Tensor],
                                                                            str | None]:
    """Collective (a log step): share every rank's window (one host all-reduce) and judge it."""
    shared = [0.0] * (3 * world)
    shared[3 * rank: 3 * rank + 3] = times.take()
    return judge(all_reduce_sum(shared), factor)


def judge(shared: list[float], factor: float) -> tuple[dict[str, float], dict[str, torch.Tensor], str | None]:
    """From every rank's (data, communication, rest) seconds per step, in rank order: the scalars, the
    per-rank lists and, when a rank is a straggler, the console line naming it."""
    data, comm, other = (torch.tensor(shared[i::3]) for i in range(3))
    busy = (data + other).tolist()
    reference = statistics.median_low(busy)
    slowest = max(range(len(busy)), key=busy.__getitem__)
    slowdown = busy[slowest] / reference if reference > 0 else 1.0
    named = slowest if slowdown > factor else -1
    scalars = {"perf/straggler_rank": float(named), "perf/straggler_slowdown": slowdown}
    per_rank = {"perf/rank_data_s": data, "perf/rank_comm_s": comm, "perf/rank_other_s": other}
    message = None
    if named >= 0:
        message = (
            f"straggler: rank {named} spends {slowdown:.2f}x the median rank's time per step outside communication "
            f"({busy[named]:.3f} s against {reference:.3f} s: data {data[named]:.3f} s, the rest {other[named]:.3f} s; "
            f"the others wait for it, up to {comm.max():.3f} s per step in collectives; "
            f"train.straggler_factor={factor})"
        )
    return scalars, per_rank, message
