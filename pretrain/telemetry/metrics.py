"""Metric sinks (JSONL file, wandb, console) and the numbers behind MFU.

Only rank 0 writes; other ranks get a logger that drops everything, so call sites need no
rank checks.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from pretrain.telemetry.log import get_logger


def measure_peak_flops(size: int = 1024, repeats: int = 6) -> float:
    """This process's dense fp32 matmul rate (FLOP/s), the CPU stand-in for a datasheet peak.

    Every rank measures at once, so ranks that share cores measure the share they really get.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def memory_stats() -> dict[str, float]:
    """Resident memory of this process (now and its peak), and the accelerator's peak allocation when
    there is one."""
    stats = {
        "memory/rss_gb": psutil.Process(os.getpid()).memory_info().rss / 2**30,
        "memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if torch.cuda.is_available():
        stats["memory/cuda_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return stats


def histogram(values: torch.Tensor) -> Any:
    """A 1-D tensor of counts as a wandb histogram (bins given by position)."""
    import wandb

    counts = values.detach().float().cpu().numpy()
    return wandb.Histogram(np_histogram=(counts, list(range(len(counts) + 1))))


METRICS_FILE = "metrics.jsonl"
STEP_KEY = "train/step"  # the x-axis of every wandb chart: the training step, which a rollback sets back


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `<run dir>/metrics.jsonl` in the order they were logged (a resumed run logs the
    steps after its checkpoint again); a last line cut short by a killed process is left out."""
    records = []
    for line in (run_dir / METRICS_FILE).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsLogger:
    """Writes metrics to `<run dir>/metrics.jsonl`, to a wandb run (offline unless credentials
    are set), and a one-line summary to the console."""

    def __init__(self, run_dir: Path, config: dict[str, Any], enabled: bool, use_wandb: bool, project: str):
        self.enabled = enabled
        self._wandb = None
        self._file = None
        if not enabled:
            return
        self._file = open(run_dir / METRICS_FILE, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if use_wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(
                project=project, name=run_dir.name, dir=str(run_dir), config=config, mode=mode,
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            )
            # wandb's own step only grows: a step redone after a rollback would be dropped if it were the
            # x-axis. Records go in at wandb's next step and are drawn against the training step instead.
            self._wandb.define_metric(STEP_KEY)
            self._wandb.define_metric("*", step_metric=STEP_KEY)

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, torch.Tensor] | None = None) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **scalars}
        if histograms:
            record.update({k: v.tolist() for k, v in histograms.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            payload: dict[str, Any] = dict(scalars)
            payload.update({k: histogram(v) for k, v in (histograms or {}).items()})
            self._wandb.log({**payload, STEP_KEY: step})

    def event(self, record: dict[str, Any], message: str) -> None:
        """A line of its own in metrics.jsonl (a record with an "event" key, not a step's metrics),
        said on the console too."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:  # its numbers, as event/<name>/<key>, at its step
            name = record["event"]
            numbers = {f"event/{name}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self._wandb.log({f"event/{name}": 1, **numbers, STEP_KEY: record.get("step", 0)})
        get_logger().warning(message)

    def console(self, message: str) -> None:
        if self.enabled:
            get_logger().info(message)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()

