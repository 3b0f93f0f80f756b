"""The straggler report: at each log step, every rank's time per step split into data wait,
communication wait and the rest, and the name of a rank that holds the others up.

In synchronous data-parallel training every rank's step takes the same wall time: a slow rank's delay
is spent by the others waiting in the next collective. So a straggler shows not in step time but in
how that time divides: it computes (or reads data, or is descheduled) while the others wait for it.
Each rank therefore measures, on a clock (`HostClock`, `DeviceClock`) and with no host sync in the step:

- data wait: the loop's data phase (reading, packing, the copy to the device);
- communication wait: the time spent in collectives;
- the rest: the step's time minus both.

On CPU the clock is the host's (`HostClock`): a thread samples the main thread's innermost Python frame
every SAMPLE_S and counts the time since the previous sample as communication when that frame is a
torch.distributed collective (COLLECTIVE_FILES): every collective DeepSpeed, FSDP2 and the trainer make
on CPU waits there. On GPUs the host does not wait in collectives (NCCL runs them on the device) and
every rank's host waits at the same device syncs, so a slow GPU would be invisible to the host; there the
clock is the device's (`DeviceClock`): the step's marks are CUDA events recorded on the current stream,
and the communication wait is the sum of NCCL's own device times of the collectives made during the
step (TORCH_NCCL_ENABLE_TIMING, read from torch's flight recorder). A collective's device time includes
its wait for the last rank to join it: the fast ranks' is long, the slow rank's short. The events' times
are read only when the window is taken, at a log step, after the host has waited for the step's loss.

Only steps that compare like with like count: not a step during which this rank's asynchronous checkpoint
commit runs (rank 0 hashes and renames in a thread, so its steps slow while the others wait: it would be
named for writing the checkpoint), and not the first step after a save or an evaluation on any rank. A
rank with no step counted in a window is left out of that window's judgment.

At a log step one host all-reduce shares the window's per-step means. A rank whose time outside
communication (data wait plus the rest) exceeds `train.straggler_factor` times the lower median of all
ranks' (with 2 ranks, the faster one's) is named on the console and in metrics.jsonl
(`perf/straggler_rank`, -1 when none is, and `perf/straggler_slowdown`, the slowest rank's ratio),
beside every rank's three times (`perf/rank_data_s`, `perf/rank_comm_s`, `perf/rank_other_s`,
lists by rank). Steps that do not log add only clock marks.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pretrain.distributed.process_group import all_reduce_sum, flight_record

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


class Clock(Protocol):
    """Where a rank's step is timed: marks of its timeline, and the time it spent in collectives."""

    def mark(self) -> Any:
        """A point of this rank's timeline, now (cheap, no sync)."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks; called only when the window is taken."""

    def comm_mark(self) -> float:
        """Where the collectives' account stands now (the step's start and end)."""

    def comm_s(self, spans: list[tuple[float, float]]) -> float:
        """Seconds spent in collectives within the counted steps' `spans` of comm marks."""

    def stop(self) -> None: ...


class HostClock:
    """The host's clock; the communication wait sampled from the main thread's frames (CommSampler)."""

    def __init__(self, world: int) -> None:
        self.sampler = CommSampler() if world > 1 else None

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def comm_mark(self) -> float:
        return self.sampler.comm_s if self.sampler else 0.0

    def comm_s(self, spans: list[tuple[float, float]]) -> float:
        return sum(end - start for start, end in spans)

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


def nccl_collectives() -> list[dict[str, Any]]:
    """This rank's flight-recorder entries (its last collectives, with NCCL's device times once done)."""
    record = flight_record()
    return json.loads(record).get("entries", []) if record else []


class DeviceClock:
    """The device's clock: CUDA events recorded on the current stream (`event`: their class); the
    communication wait from the device times of the collectives `collectives()` lists (each entry's
    `record_id`, `time_created_ns` on the host's wall clock and, once done, `duration_ms`), those created
    within a counted step, each counted once."""

    def __init__(self, event: Callable[..., Any] | None = None,
                 collectives: Callable[[], list[dict[str, Any]]] = nccl_collectives) -> None:
        self.event = event or torch.cuda.Event
        self.collectives = collectives
        self.counted_to = -1  # the record ids up to this one are accounted for

    def mark(self) -> Any:
        event = self.event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()  # done already at a log step: the host has read the step's loss
        return start.elapsed_time(end) / 1000.0

    def comm_mark(self) -> float:
        return float(time.time_ns())

    def comm_s(self, spans: list[tuple[float, float]]) -> float:
        total = 0.0
        for entry in sorted(self.collectives(), key=lambda e: e["record_id"]):
            if entry["record_id"] <= self.counted_to:
                continue
            if entry.get("duration_ms") is None:
                break  # not done yet: it and those after it are counted with the next window
            self.counted_to = entry["record_id"]
            if any(start <= entry["time_created_ns"] <= end for start, end in spans):
                total += entry["duration_ms"] / 1000.0
        return total

    def stop(self) -> None:
        """Nothing runs beside the steps."""


def clock_for(device: torch.device, world: int) -> Clock:
    """The device's clock on a GPU, else the host's."""
    return DeviceClock() if device.type == "cuda" else HostClock(world)


class StepTimes:
    """This rank's counted steps since the last report, as marks of `clock` (read when taken); the loop
    marks each step's start, the end of its data phase and its end."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.steps: list[tuple[Any, Any, Any]] = []  # start, data ready, end
        self.spans: list[tuple[float, float]] = []  # the comm marks at each counted step's start and end
        self._marks: list[Any] = []
        self._comm_at_start = 0.0
        self._skip_next = False

    def step_begins(self) -> None:
        self._marks = [self.clock.mark()]
        self._comm_at_start = self.clock.comm_mark()

    def data_ready(self) -> None:
        self._marks.append(self.clock.mark())

    def skip_next(self) -> None:
        """Leave the next step out (the first after a save or an evaluation, on every rank)."""
        self._skip_next = True

    def step_ends(self, counted: bool = True) -> None:
        """The step is done; it counts unless `counted` is False (a checkpoint commit of this rank ran
        during it) or it was to be skipped."""
        if counted and not self._skip_next:
            start, data = self._marks
            self.steps.append((start, data, self.clock.mark()))
            self.spans.append((self._comm_at_start, self.clock.comm_mark()))
        self._skip_next = False

    def take(self) -> tuple[float, float, float, float]:
        """(data, communication, rest) seconds per counted step since the last call and the number of
        counted steps, and start a new window."""
        counted = max(len(self.steps), 1)
        data = sum(self.clock.seconds(start, ready) for start, ready, _ in self.steps) / counted
        step = sum(self.clock.seconds(start, end) for start, _, end in self.steps) / counted
        comm = min(self.clock.comm_s(self.spans) / counted, step - data)
        window = float(len(self.steps))
        self.steps, self.spans = [], []
        return data, comm, step - data - comm, window

    def stop(self) -> None:
        self.clock.stop()


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
