"""Scaling-law sweeps: plan the grid, run it (locally, on SLURM, or anywhere), collect, fit.

    python launch/sweep.py plan    --sweep configs/sweeps/cpu-demo.yaml [--json plan.json]
    python launch/sweep.py run     --sweep configs/sweeps/cpu-demo.yaml [--executor local|slurm|print] [--parallel K]
    python launch/sweep.py collect --sweep configs/sweeps/cpu-demo.yaml [--out DIR]
    python launch/sweep.py fit     --results results.csv --json fit.json [--plots DIR]

Run from the repository root. Every cell is an ordinary `launch/pretrain.py` run; re-running
`run` skips finished cells and resumes interrupted ones from their checkpoints. Exit codes: 0 done,
1 a cell failed, 2 bad input, 3 stopped before every cell finished (re-run to continue).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # planning builds models only to count them
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.sweeps.results import cell_status, collect_results
from pretrain.sweeps.scaling import ScalingFitError
from pretrain.sweeps.spec import SweepError, format_plan, load_sweep, plan_sweep

EXIT_BAD_INPUT = 2


def _plan(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep)
    cells, skipped = plan_sweep(sweep)
    print(format_plan(cells))
    status = [cell_status(c) for c in cells]
    print(f"\n{len(cells)} cells, {sum(c.flops for c in cells):.3g} FLOPs in total; "
          f"{status.count('done')} finished, {status.count('partial')} started, {status.count('todo')} to do")
    for line in skipped:
        print(f"left out: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": [c.row() for c in cells], "left_out": skipped}, indent=1))
    return 0


def _run(args: argparse.Namespace) -> int:
    from pretrain.sweeps.run import LocalExecutor, print_commands, submit_slurm

    sweep = load_sweep(args.sweep)
    cells, _ = plan_sweep(sweep)
    if args.only:
        chosen = [c for c in cells if any(part in c.name for part in args.only)]
        if not chosen:
            raise SweepError(f"--only {' '.join(args.only)}: no cell of {args.sweep} has that in its name "
                             f"(names look like {cells[0].name})")
        cells = chosen
    if args.executor == "print":
        return print_commands(sweep, cells)
    if args.executor == "slurm":
        return submit_slurm(sweep, cells)
    return LocalExecutor(sweep, args.parallel, say=lambda line: print(line, flush=True)).run(cells)


def _collect(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep)
    cells, _ = plan_sweep(sweep)
    rows, missing = collect_results(cells)
    out = Path(args.out) if args.out else sweep.out
    out.mkdir(parents=True, exist_ok=True)
    if rows:
        with open(out / "results.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} finished cells -> {out / 'results.csv'} and {out / 'results.jsonl'}")
    if missing:
        print(f"{len(missing)} cells not finished: {', '.join(missing)}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from pretrain.sweeps.scaling import fit_results, format_fit, load_results

    data = load_results(args.results, params_column=args.params_column)
    fits = fit_results(data, bootstrap=args.bootstrap, seed=args.seed, starts=args.starts or None)
    print(format_fit(fits))
    if args.json:
        Path(args.json).write_text(json.dumps(fits, indent=1))
    if args.plots:
        from pretrain.sweeps.plots import plot_all

        for path in plot_all(data, fits, Path(args.plots)):
            print(f"plot: {path}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print the grid, one row per cell")
    plan.add_argument("--sweep", required=True, help="sweep file (configs/sweeps/*.yaml)")
    plan.add_argument("--json", help="also write the plan as JSON here")
    run = commands.add_parser("run", help="train every unfinished cell")
    run.add_argument("--sweep", required=True)
    run.add_argument("--executor", choices=["local", "slurm", "print"], default="local")
    run.add_argument("--parallel", type=int, default=1,
                     help="local cells at a time; the cores are divided between them")
    run.add_argument("--only", nargs="+", metavar="PART",
                     help="run only the cells whose name contains one of these (e.g. C2.40e+12, vort/)")
    collect = commands.add_parser("collect", help="gather finished cells into results.csv and results.jsonl")
    collect.add_argument("--sweep", required=True)
    collect.add_argument("--out", help="directory for the results (default: the sweep's out)")
    fit = commands.add_parser("fit", help="fit L(N, D) and the compute-optimal exponents per family")
    fit.add_argument("--results", required=True, help="CSV with at least family,params,tokens,loss (flops optional)")
    fit.add_argument("--json", help="write the fit here")
    fit.add_argument("--plots", help="directory for the PNG plots")
    fit.add_argument("--params-column", default="params", help="the CSV column used as N (e.g. params_no_embed)")
    fit.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals")
    fit.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    fit.add_argument("--starts", type=int, default=100,
                     help="L-BFGS-B runs from this many of the best grid starting points; 0: from all 4,500")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handler = {"plan": _plan, "run": _run, "collect": _collect, "fit": _fit}[args.command]
    try:
        return handler(args)
    except (SweepError, ScalingFitError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
