"""`python -m pretrain.telemetry.plot <run dir> [--out curves.png]`: a run's curves from its metrics.jsonl.

Three panels: the training loss, the throughput (tokens/s over all ranks), and every held-out
evaluation the run logged (`eval/*`: bits per token at each context, task accuracies), each against
the step. Where a resumed run logged a step twice (the steps after its checkpoint are redone), the
later value is drawn. Reads the file only, so it works on a run in progress.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pretrain.telemetry.metrics import METRICS_FILE, read_metrics

PANELS = (("train/loss", "training loss (nats)"), ("perf/tokens_per_s", "tokens/s"))


def curves(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values) of every training, throughput and eval/ metric, one value per step
    (the last logged), steps in order."""
    by_metric: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in record.items():
            wanted = key in dict(PANELS) or key.startswith("eval/")
            if wanted and isinstance(value, (int, float)) and "step" in record:
                by_metric.setdefault(key, {})[int(record["step"])] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_metric.items()}


def plot(run_dir: Path, out: Path) -> dict[str, int]:
    """Draw the run's curves to the PNG `out`; returns the points drawn per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = curves(read_metrics(run_dir))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, label) in zip(axes, PANELS):
        if key in series:
            ax.plot(*series[key], marker="." if len(series[key][0]) < 50 else None)
        ax.set(xlabel="step", ylabel=label, title=key)
    evals = sorted(k for k in series if k.startswith("eval/"))
    for key in evals:
        axes[2].plot(*series[key], marker="o", label=key.removeprefix("eval/"))
    axes[2].set(xlabel="step", title="held-out evaluation" if evals else "held-out evaluation (none logged)")
    if evals:
        axes[2].legend(fontsize=7)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return {key: len(steps) for key, (steps, _) in series.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.telemetry.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (holding metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="the PNG to write (default: <run dir>/curves.png)")
    args = parser.parse_args(argv)
    if not (args.run_dir / METRICS_FILE).is_file():
        print(f"error: {args.run_dir}: no {METRICS_FILE} (the run directory of a launch/pretrain.py run holds one)",
              file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "curves.png"
    drawn = plot(args.run_dir, out)
    print(f"wrote {out}: " + ", ".join(f"{key} ({n} steps)" for key, n in sorted(drawn.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
