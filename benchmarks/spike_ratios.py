"""How far each logged loss rises over the median of the losses before it: the margin behind the
defaults of `train.spike` (docs/training.md, "Loss spikes").

    python -m benchmarks.spike_ratios runs/demo/metrics.jsonl --window 10 50

For each run (metrics.jsonl logged with train.log_every=1, so every step's loss is there) and each
window, prints the largest ratio loss / median of the `window` finite losses before it, the step where
it happened, and how many steps were judged; the rule of pretrain/resilience/spike.py flags a step whose ratio
exceeds train.spike.factor. A run with rollbacks logs some steps twice; each logged value is taken in
the order it was written.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pretrain.config import SpikeSection
from pretrain.resilience.spike import SpikeDetector


def ratios(losses: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """(step, loss / median of the `window` finite losses before it) for every step with a full window,
    judged by the detector itself (pretrain/resilience/spike.py)."""
    detector = SpikeDetector(SpikeSection(window=window))
    out = []
    for step, loss in losses:
        median = detector.observe(loss)
        if median is not None:
            out.append((step, loss / median))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files")
    parser.add_argument("--window", nargs="+", type=int, default=[50])
    args = parser.parse_args(argv)
    print(f"{'run':<48} {'window':>6} {'steps judged':>12} {'largest ratio':>13} {'at step':>7}")
    for path in args.metrics:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        losses = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
        for window in args.window:
            judged = ratios(losses, window)
            step, worst = max(judged, key=lambda item: item[1]) if judged else (0, math.nan)
            print(f"{path!s:<48} {window:>6} {len(judged):>12} {worst:>13.3f} {step:>7}")


if __name__ == "__main__":
    main()
