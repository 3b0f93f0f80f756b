"""``python -m model.soe``: certify an SOE kernel and print it (one JSON object with ``--json``).

    python -m model.soe --T 524288 --eps 1e-3 --alpha 0.2 --alpha 0.5 --alpha 0.95 --json

The JSON shape (T, eps, S, log_lambda, coef keyed by the --alpha text, max_rel_err) is relied on by
tools outside the project.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from model.soe.certificate import DEFAULT_ALPHA_RANGE, certify


def _alpha_arg(text: str) -> str:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"alpha must lie in (0, 1], got {text}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: certify an SOE kernel and print it (JSON with --json)."""
    parser = argparse.ArgumentParser(prog="python -m model.soe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=524288, help="horizon: certify every lag n in [0, T]")
    parser.add_argument("--eps", type=float, default=1e-3, help="max relative error to meet")
    parser.add_argument("--alpha", type=_alpha_arg, action="append", default=[],
                        help="order to emit coefficients for (repeatable); keys keep the text given")
    parser.add_argument("--alpha-min", type=float, default=DEFAULT_ALPHA_RANGE[0],
                        help="lower end of the order range the shared nodes are designed for")
    parser.add_argument("--alpha-max", type=float, default=DEFAULT_ALPHA_RANGE[1],
                        help="upper end of the order range the shared nodes are designed for")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    alphas = [float(a) for a in args.alpha] or None
    cert = certify(args.T, args.eps, alphas, alpha_range=(args.alpha_min, args.alpha_max))
    keys = list(args.alpha) or [repr(float(a)) for a in cert.kernel.banks]
    if args.json:
        out = {
            "T": args.T,
            "eps": args.eps,
            "S": cert.S,
            "log_lambda": cert.kernel.log_lambda.tolist(),
            "coef": {k: row.tolist() for k, row in zip(keys, cert.kernel.coef)},
            "max_rel_err": cert.max_rel_err,
        }
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"T={cert.T} eps={cert.eps:g} S={cert.S} alpha range={cert.alpha_range}")
        print(f"design-grid max rel err={cert.design_err:.3e}")
        for k, err in zip(keys, cert.rel_err):
            print(f"  alpha={k}: max rel err over n in [0, T] = {err:.3e}")
    return 0
