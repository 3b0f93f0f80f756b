"""Compare models' long-context curves from pretrain.evaluate's JSON reports: one table, one plot.

    python -m pretrain.evaluate.compare vort=eval_vort.json pmnet=eval_pmnet.json ... \\
        [--plot curves.png] [--train-len 256] [--title "..."]

Prints a Markdown table of bits per token at every context any report has (one row per model)
and, with --plot, draws two panels: bits per token against context, and against the position in
the longest context each report has (its log-spaced buckets).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def table(reports: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per model, one column per context; '-' where a model was not scored."""
    contexts = sorted({int(c) for r in reports.values() for c, v in r["contexts"].items() if "bits_per_token" in v})
    lines = ["| model | " + " | ".join(f"{c:,}" for c in contexts) + " |", "|---" * (len(contexts) + 1) + "|"]
    for name, report in reports.items():
        cells = []
        for c in contexts:
            result = report["contexts"].get(str(c), {})
            cells.append(f"{result['bits_per_token']:.3f}" if "bits_per_token" in result else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(reports: dict[str, dict[str, Any]], path: str, title: str, train_len: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, report in reports.items():
        scored = sorted((int(c), v) for c, v in report["contexts"].items() if "bits_per_token" in v)
        left.plot([c for c, _ in scored], [v["bits_per_token"] for _, v in scored], marker="o", label=name)
        longest = scored[-1][1]["buckets"]
        mids = [max(1.0, (b["start"] + b["end"] - 1) / 2) for b in longest]
        right.plot(mids, [b["bits_per_token"] for b in longest], marker=".", label=f"{name} ({scored[-1][0]:,})")
    for ax, xlabel in ((left, "context (tokens)"), (right, "position in the longest context (tokens)")):
        ax.set_xscale("log", base=2)
        if train_len:
            ax.axvline(train_len, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("bits per token")
        ax.grid(True, alpha=0.3)
    values = sorted(y for line in right.get_lines() for y in line.get_ydata())
    low = values[len(values) // 20]  # the first few positions of one window are noisy and far off
    right.set_ylim(low - 0.3, low + 2.5)
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.evaluate.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="name=report.json (pretrain.evaluate --json)")
    parser.add_argument("--plot", help="write the two-panel PNG here")
    parser.add_argument("--train-len", type=int, default=None, help="mark the training length on the plot")
    parser.add_argument("--title", default="bits per token against context")
    args = parser.parse_args(argv)
    reports = {}
    for item in args.reports:
        name, sep, path = item.partition("=")
        if not sep or not name:
            print(f"error: {item!r}: expected name=report.json", file=sys.stderr)
            return 2
        try:
            reports[name] = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"error: {path}: {err}", file=sys.stderr)
            return 2
        if not isinstance(reports[name].get("contexts"), dict):
            print(f"error: {path}: not a pretrain.evaluate report (no 'contexts')", file=sys.stderr)
            return 2
    print(table(reports))
    if args.plot:
        plot(reports, args.plot, args.title, args.train_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
