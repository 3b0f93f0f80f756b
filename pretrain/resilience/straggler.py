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

Only steps that compare like with like count: not a step during which this rank's asynchronous checkpoint
commit runs (rank 0 hashes and renames in a thread, so its steps slow while the others wait: it would be
named for writing the checkpoint), and not the first step after a save or an evaluation on any rank. A
rank with no step counted in a window is left out of that window's judgment.

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
    """This rank's data wait, communication wait and step time summed over the counted steps since the
    last report; the loop marks each step's start, the end of its data phase and its end."""

    def __init__(self, world: int) -> None:
        self.sampler = CommSampler() if world > 1 else None
        self.data_s = self.step_s = self.comm_s = 0.0
        self.steps = 0
        self._started = self._data_s = self._comm_at_start = 0.0
        self._skip_next = False

    def _comm_total(self) -> float:
        return self.sampler.comm_s if self.sampler else 0.0

    def step_begins(self) -> None:
        self._started = time.perf_counter()
        self._comm_at_start = self._comm_total()

    def data_ready(self) -> None:
        self._data_s = time.perf_counter() - self._started

    def skip_next(self) -> None:
        """Leave the next step out (the first after a save or an evaluation, on every rank)."""
        self._skip_next = True

    def step_ends(self, counted: bool = True) -> None:
        """The step is done; it counts unless `counted` is False (a checkpoint commit of this rank ran
        during it) or it was to be skipped."""
        if counted and not self._skip_next:
            self.step_s += time.perf_counter() - self._started
            self.data_s += self._data_s
            self.comm_s += self._comm_total() - self._comm_at_start
            self.steps += 1
        self._skip_next = False

    def take(self) -> tuple[float, float, float, float]:
        """(data, communication, rest) seconds per counted step since the last call and the number of
        counted steps, and start a new window."""
        steps = max(self.steps, 1)
        data, step = self.data_s / steps, self.step_s / steps
        comm = min(self.comm_s / steps, step - data)
        counted = float(self.steps)
        self.data_s = self.step_s = self.comm_s = 0.0
        self.steps = 0
        return data, comm, step - data - comm, counted

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


def report(times: StepTimes, rank: int, world: int, factor: float) -> tuple[dict[str, float], dict[str, torch.Tensor],
                                                                            str | None]:
    """Collective (a log step): share every rank's window (one host all-reduce) and judge it."""
    shared = [0.0] * (FIELDS * world)
    shared[FIELDS * rank: FIELDS * (rank + 1)] = times.take()
    return judge(all_reduce_sum(shared), factor)


FIELDS = 4  # per rank: data, communication, rest (seconds per counted step), counted steps


def judge(shared: list[float], factor: float) -> tuple[dict[str, float], dict[str, torch.Tensor], str | None]:
    """From every rank's (data, communication, rest, counted steps), in rank order: the scalars, the
    per-rank lists and, when a rank is a straggler, the console line naming it. Ranks with no counted step
    are left out of the judgment."""
    data, comm, other, counted = (torch.tensor(shared[i::FIELDS]) for i in range(FIELDS))
    busy = (data + other).tolist()
    judged = [r for r in range(len(busy)) if counted[r] > 0]
    reference = statistics.median_low([busy[r] for r in judged]) if judged else 0.0
    slowest = max(judged, key=busy.__getitem__) if judged else 0
    slowdown = busy[slowest] / reference if reference > 0 else 1.0
    named = slowest if slowdown > factor and len(judged) > 1 else -1
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
