"""The straggler report (pretrain/resilience/straggler.py): the judgment on given times, the steps left out of
it, and a 2-rank run in which one rank is slowed from outside by a SIGSTOP/SIGCONT duty cycle and must be the
rank named, while the other, which writes the checkpoints, never is."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest

from pretrain.resilience.straggler import DeviceClock, HostClock, StepTimes, judge
from tests.launchers import logged
from tests.test_hang import _rank_process
from tests.test_preemption import start, wait_for_step
from tests.test_resume import config_args, step_losses


def test_a_rank_slower_than_the_median_by_the_factor_is_named() -> None:
    # (data, communication, rest, counted steps) per rank: rank 2 computes 0.9 s a step while the others wait
    shared = [0.01, 0.50, 0.40, 10, 0.02, 0.48, 0.42, 10, 0.01, 0.00, 0.90, 10, 0.01, 0.49, 0.41, 10]
    scalars, per_rank, message = judge(shared, factor=1.5)
    assert scalars["perf/straggler_rank"] == 2
    assert scalars["perf/straggler_slowdown"] == pytest.approx(0.91 / 0.42)  # against the lower median
    assert per_rank["perf/rank_other_s"].tolist() == pytest.approx([0.40, 0.42, 0.90, 0.41])
    assert message is not None and message.startswith("straggler: rank 2 spends 2.17x")
    calm, _, quiet = judge(shared, factor=2.5)
    assert calm["perf/straggler_rank"] == -1 and quiet is None
    two = judge([0.0, 0.3, 0.2, 10, 0.0, 0.0, 0.5, 10], factor=1.5)[0]  # two ranks: compared with the faster one
    assert two["perf/straggler_rank"] == 1 and two["perf/straggler_slowdown"] == pytest.approx(2.5)
    # a rank with no step counted in the window (its commit ran throughout) is not judged
    left_out = judge([0.0, 0.3, 0.2, 10, 0.0, 0.0, 0.0, 0, 0.0, 0.3, 0.21, 10], factor=1.5)[0]
    assert left_out["perf/straggler_rank"] == -1 and left_out["perf/straggler_slowdown"] == pytest.approx(1.05)
    alone = judge([0.0, 0.3, 0.2, 10, 0.0, 0.0, 0.9, 0], factor=1.5)[0]
    assert alone["perf/straggler_rank"] == -1


def test_steps_under_a_commit_or_after_a_save_are_not_counted() -> None:
    """The steps of a rank whose checkpoint commit runs during them, and the first step after a save or an
    evaluation, stay out of the window: the 0.2 s steps here never reach the means."""
    times = StepTimes(HostClock(world=1))
    for seconds, counted, skip in [(0.02, True, False), (0.2, False, False), (0.2, True, True), (0.02, True, False)]:
        if skip:
            times.skip_next()
        times.step_begins()
        time.sleep(0.005)
        times.data_ready()
        time.sleep(seconds)
        times.step_ends(counted=counted)
    data, comm, rest, counted_steps = times.take()
    assert counted_steps == 2 and comm == 0.0
    assert 0.004 < data < 0.05 and 0.019 < rest < 0.1, (data, rest)
    assert times.take()[3] == 0  # a new window


class FakeDevice:
    """A device timeline for CUDA events on CPU: each event recorded lands at `now` (what the test says
    the device reached); reading an event's time before the device has `finished` would be a host sync
    inside the step, and fails."""

    def __init__(self) -> None:
        self.now, self.finished = 0.0, False

    def event(self, enable_timing: bool = False) -> FakeDevice.Event:
        assert enable_timing
        return FakeDevice.Event(self)

    class Event:
        def __init__(self, device: FakeDevice) -> None:
            self.device, self.at = device, None

        def record(self) -> None:
            self.at = self.device.now

        def synchronize(self) -> None:
            assert self.device.finished, "an event waited for inside the step"

        def elapsed_time(self, end: FakeDevice.Event) -> float:
            assert self.device.finished, "an event read inside the step"
            return (end.at - self.at) * 1000.0


def test_on_the_device_the_step_is_split_by_cuda_events_and_nccls_collective_times() -> None:
    """The device's clock: the host's times say nothing (the host waits the same on every rank); the
    events' times split each step into data (0.01 s), collectives (NCCL's device times of those created
    during a counted step, each once) and the rest. No event is read before the window is taken."""
    device = FakeDevice()
    collectives: list[dict] = []
    clock = DeviceClock(device.event, lambda: list(collectives))
    times = StepTimes(clock)
    record = 0
    for step, counted in enumerate([True, False, True]):
        times.step_begins()
        created = time.time_ns()
        device.now += 0.01
        times.data_ready()
        device.now += 0.5
        times.step_ends(counted=counted)
        for _ in range(2):  # two collectives of the step, 0.2 s each on the device
            record += 1
            collectives.append({"record_id": record, "time_created_ns": created, "duration_ms": 200.0})
        if step == 1:  # a checkpoint's collective between steps: in no counted step
            record += 1
            collectives.append({"record_id": record, "time_created_ns": time.time_ns() + 10**9, "duration_ms": 9e3})
    collectives.append({"record_id": record + 1, "time_created_ns": created})  # not done yet: no device time
    device.finished = True
    data, comm, rest, counted_steps = times.take()
    assert counted_steps == 2
    assert (data, comm, rest) == pytest.approx((0.01, 0.4, 0.1))
    collectives[-1]["duration_ms"] = 100.0  # done by the next window, in none of its steps
    assert times.take() == (0.0, 0.0, 0.0, 0.0)
    assert clock.counted_to == record + 1  # each collective counted once


def duty_cycle(process: psutil.Process, stopped_s: float, running_s: float, until: threading.Event) -> None:
    """SIGSTOP `process` for `stopped_s`, SIGCONT it for `running_s`, until `until` is set."""
    while not until.is_set():
        process.suspend()
        time.sleep(stopped_s)
        process.resume()
        time.sleep(running_s)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_a_rank_slowed_from_outside_is_the_one_named(engine: str, demo_shards: dict[str, str],
                                                     tmp_path: Path) -> None:
    launcher = "deepspeed" if engine == "deepspeed" else "torchrun"
    # rank 0 also writes a checkpoint every 10 steps (committed in the background): it must never be named
    args = config_args(demo_shards, tmp_path, [f"engine.kind={engine}", "train.steps=100000", "checkpoint.every=10",
                                                "checkpoint.async_save=true", "train.log_every=10"])
    log = tmp_path / "log.txt"
    with start(launcher, 2, args, log) as proc:
        wait_for_step(proc, tmp_path, 30, log)  # three windows of the undisturbed run
        slowed_from = max(step_losses(tmp_path))
        done = threading.Event()
        cycle = threading.Thread(target=duty_cycle, args=(_rank_process(proc.pid, 1), 0.15, 0.1, done))
        cycle.start()
        try:
            wait_for_step(proc, tmp_path, slowed_from + 60, log)
        finally:
            done.set()
            cycle.join()
    steps = logged(tmp_path, "step")
    named = dict(zip(steps, logged(tmp_path, "perf/straggler_rank")))
    slowdown = dict(zip(steps, logged(tmp_path, "perf/straggler_slowdown")))
    print({s: (named[s], round(slowdown[s], 2)) for s in steps})
    during = [named[s] for s in steps if s > slowed_from + 10]  # windows wholly inside the duty cycle
    assert len(during) >= 5
    assert 0 not in during, during  # the rank that waits for it is never blamed
    assert during.count(1) >= 2 / 3 * len(during), during
    assert "straggler: rank 1 spends" in log.read_text()
