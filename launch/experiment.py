"""Run one of the papers' experiments at CPU scale: train its families, evaluate, write results.

    python launch/experiment.py list
    python launch/experiment.py run <name> [--quick] [--seeds N] [--first-seed K] [--out DIR] [--parallel K]
                                       [--families A,B] [--set KEY=VALUE ...]

Results go to <out>/<name>/results.json, results.csv and plot.png (runs under <out>/runs/,
shared by experiments that train the same family on the same config). A rerun skips the runs
already trained and evaluated, so an interrupted experiment resumes where it stopped. --quick
trains every family for two steps on short sequences (a smoke test, not a result). --parallel K
trains K runs at a time, each on its own share of the cores; the results are the same as one at a
time. --set KEY=VALUE (repeatable, e.g. --set model.pmnet.balance_loss=0) changes every family
of the run the same way: a variant of the experiment, which wants its own --out. --first-seed K
--seeds N trains seeds K to K+N-1, so seeds can be added to a sweep that has the first ones.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import EXPERIMENTS
from experiments.runner import ExperimentError
from pretrain.config import ConfigError
from pretrain.telemetry.log import setup_logging

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the experiments, their families and seeds")
    run = commands.add_parser("run", help="train, evaluate and write the results of one experiment")
    run.add_argument("name", choices=sorted(EXPERIMENTS))
    run.add_argument("--quick", action="store_true", help="two training steps per run, short sequences")
    run.add_argument("--seeds", type=int, default=None, help="seeds per family (default: the experiment's)")
    run.add_argument("--first-seed", type=int, default=0,
                     help="the first seed (default 0): --first-seed 1 --seeds 2 adds seeds 1 and 2 to a seed-0 sweep")
    run.add_argument("--out", type=Path, default=Path("runs/experiments"), help="where runs and results go")
    run.add_argument("--parallel", type=int, default=1, help="runs trained at a time (default 1)")
    run.add_argument("--families", default="", help="comma-separated family names: run only these "
                     "(results under <out>/<name>/<names joined by +>)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="a config override for every family (repeatable); use another --out than the plain run's")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, experiment in EXPERIMENTS.items():
            families = ", ".join(f.name for f in experiment.families)
            print(f"{name:10s} {experiment.title}\n{'':10s} families: {families}; seeds: {experiment.seeds}; "
                  f"config: configs/experiments/{experiment.config}")
        return 0
    if args.seeds is not None and args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.first_seed < 0:
        parser.error("--first-seed must be >= 0")
    setup_logging("WARNING")
    try:
        only = tuple(name for name in args.families.split(",") if name)
        results = EXPERIMENTS[args.name].run(args.out, args.seeds, args.quick, parallel=args.parallel, only=only,
                                             overrides=args.overrides, first_seed=args.first_seed)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    target = EXPERIMENTS[args.name].results_dir(args.out, list(results["families"]) if only else ())
    print(f"wrote {target}/results.json, results.csv, plot.png ({len(results['runs'])} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
