"""The launch model's constants fitted on published H100 times of fla's chunk linear attention, and the
check of every prediction against its measurement.

    python -m benchmarks.predict.calibrate [--fit] [--json out.json]

`MEASURED` is the table of issue 54: fla's own benchmark (benchmarks/ops/run.py of fla, do_bench
medians) of `chunk_linear_attn` on an H100, bf16, D = DV, at the shapes of fla's benchmark registry.
The fit takes the forward times of all six shapes and the forward + backward times of the four largest
(by B*T*H*D) and minimises the squared log ratio of predicted to measured over the six constants of
`launch_model.Constants`, within physical bounds (`BOUNDS`). The other two forward + backward times
are reported beside their predictions: they are dominated by what the model leaves out (the host's
Python and launch time of fla's backward, which issues its kernels faster than they run only at large
shapes). Without --fit it checks the constants the model ships with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.predict.fla_ops import capture_op
from benchmarks.predict.gpu import H100
from benchmarks.predict.launch_model import Constants
from benchmarks.predict.price import Costed, cost

Shape = tuple[int, int, int, int]
MEASURED: dict[Shape, tuple[float, float]] = {  # (B, T, H, D): (forward ms, forward + backward ms)
    (1, 8192, 96, 128): (0.726, 3.367),
    (2, 16384, 16, 128): (0.609, 2.585),
    (4, 2048, 16, 128): (0.148, 1.547),
    (4, 4096, 64, 128): (0.950, 4.530),
    (8, 2048, 32, 256): (1.338, 8.981),
    (8, 1024, 8, 64): (0.137, 0.796),
}
OP = "linear_attn"
BOUND = 0.35  # every fitted prediction within +-35% of its measurement
BOUNDS = {  # physical ranges of the constants
    "hmma_efficiency": (0.3, 1.0),
    "cycles_per_instruction": (1.0, 16.0),
    "load_latency_cycles": (200.0, 1500.0),
    "hbm_efficiency": (0.5, 0.95),
    "launch_seconds": (1e-6, 2e-5),
    "host_seconds_per_launch": (5e-6, 1.5e-4),
}


def fitted_cases() -> list[tuple[Shape, bool]]:
    """The (shape, backward) pairs the fit uses: every forward, forward + backward of the 4 largest."""
    largest = sorted(MEASURED, key=math.prod, reverse=True)[:4]
    return [(s, False) for s in MEASURED] + [(s, True) for s in MEASURED if s in largest]


def costed_cases() -> dict[tuple[Shape, bool], Costed]:
    """Every measured case captured and costed (compiles each launch: minutes the first time, then
    triton's cache)."""
    return {(s, b): cost(capture_op(OP, s, b), H100) for s in MEASURED for b in (False, True)}


def fit(cases: dict[tuple[Shape, bool], Costed]) -> Constants:
    """The constants minimising the squared log error over `fitted_cases`."""
    from scipy.optimize import minimize

    names = [f.name for f in dataclasses.fields(Constants)]
    lo = [math.log(BOUNDS[n][0]) for n in names]
    hi = [math.log(BOUNDS[n][1]) for n in names]
    used = fitted_cases()

    def loss(x: Sequence[float]) -> float:
        c = Constants.from_vector([math.exp(v) for v in x])
        return sum(math.log(cases[k].seconds(c) * 1e3 / MEASURED[k[0]][k[1]]) ** 2 for k in used)

    start = [math.log(v) for v in Constants().vector()]
    best = minimize(loss, start, method="Powell", bounds=list(zip(lo, hi)), options={"xtol": 1e-4, "ftol": 1e-8})
    return Constants.from_vector([float(f"{math.exp(v):.4g}") for v in best.x])


def report(cases: dict[tuple[Shape, bool], Costed], c: Constants) -> list[dict]:
    """One row per measured case: predicted, measured, ratio, whether fitted and within the bound."""
    used = set(fitted_cases())
    rows = []
    for (shape, backward), costed in cases.items():
        predicted = costed.seconds(c) * 1e3
        measured = MEASURED[shape][backward]
        rows.append({"shape": "B{} T{} H{} D{}".format(*shape), "mode": "fwdbwd" if backward else "fwd",
                     "predicted_ms": round(predicted, 3), "measured_ms": measured,
                     "ratio": round(predicted / measured, 3), "fitted": (shape, backward) in used,
                     "within_bound": abs(predicted / measured - 1) <= BOUND})
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'shape':22} {'mode':7} {'predicted ms':>12} {'measured ms':>11} {'ratio':>6}  fitted"
    lines = [head] + [f"{r['shape']:22} {r['mode']:7} {r['predicted_ms']:12.3f} {r['measured_ms']:11.3f} "
                      f"{r['ratio']:6.2f}  {'yes' if r['fitted'] else 'no (reported)'}" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit the constants (else check the shipped ones)")
    parser.add_argument("--json", type=Path, help="write the constants and rows here")
    args = parser.parse_args(argv)
    cases = costed_cases()
    c = fit(cases) if args.fit else Constants()
    rows = report(cases, c)
    print(f"constants: {dataclasses.asdict(c)}")
    print(format_rows(rows))
    bad = [r for r in rows if r["fitted"] and not r["within_bound"]]
    print(f"{sum(r['fitted'] for r in rows)} fitted cases, {len(bad)} outside +-{BOUND:.0%}")
    if args.json:
        args.json.write_text(json.dumps({"constants": dataclasses.asdict(c), "rows": rows}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
