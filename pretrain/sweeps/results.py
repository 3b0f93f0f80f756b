"""What a sweep's cells left behind: whether each is finished, its final held-out loss, its
training time, and the results table of every finished cell."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

from pretrain.checkpoint.layout import MANIFEST, step_dir_name
from pretrain.sweeps.spec import Cell


def final_loss(run_dir: Path, steps: int) -> tuple[str, float] | None:
    """(metric name, value) of the held-out loss logged at the final step, or None."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    found = None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if record.get("step") != steps:
            continue
        for key, value in record.items():
            if key.startswith("eval/bits_per_token@"):
                found = (key.removeprefix("eval/"), float(value))
    return found


def cell_status(cell: Cell) -> str:
    """"done" (final checkpoint committed and final loss logged), "partial" (started) or "todo"."""
    run_dir = Path(cell.run_dir)
    fs, root = url_to_fs(cell.checkpoint_root)
    if fs.exists(f"{root}/{step_dir_name(cell.steps)}/{MANIFEST}") and final_loss(run_dir, cell.steps) is not None:
        return "done"
    return "partial" if (run_dir / "config.yaml").is_file() else "todo"


def train_time(run_dir: Path, tokens_per_step: int) -> float:
    """Seconds spent in training steps, from the throughput logged for each window (every attempt
    of the run; the first window after a resume is taken as one logging interval long)."""
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if record.get("perf/tokens_per_s", 0) > 0:
                records.append((record["step"], record["perf/tokens_per_s"]))
    deltas = [b[0] - a[0] for a, b in itertools.pairwise(records) if b[0] > a[0]]
    interval = max(set(deltas), key=deltas.count) if deltas else (records[0][0] if records else 0)
    seconds, previous = 0.0, 0
    for step, rate in records:
        steps = step - previous if step > previous else min(step, interval)
        seconds += steps * tokens_per_step / rate
        previous = step
    return seconds


def collect_results(cells: list[Cell]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per finished cell (loss named by unit), and the names of unfinished cells."""
    rows, missing = [], []
    for cell in cells:
        run_dir = Path(cell.run_dir)
        loss = final_loss(run_dir, cell.steps) if cell_status(cell) == "done" else None
        if loss is None:
            missing.append(cell.name)
            continue
        seconds = train_time(run_dir, cell.tokens_per_step)
        rows.append({
            "family": cell.family, "params": cell.params, "tokens": cell.tokens, "loss": loss[1],
            "flops": cell.flops, "budget": cell.budget if cell.budget is not None else "",
            "params_no_embed": cell.params_no_embed, "d_model": cell.shape.d_model,
            "n_layers": cell.shape.n_layers, "seed": cell.seed, "steps": cell.steps,
            "loss_unit": "bits_per_byte" if cell.tokenizer == "bytes" else "bits_per_token",
            "loss_metric": loss[0], "train_seconds": round(seconds, 2),
            "tokens_per_s": round(cell.tokens / seconds, 1) if seconds > 0 else "",
            "lr": cell.lr, "run_dir": cell.run_dir,
        })
    return rows, missing
