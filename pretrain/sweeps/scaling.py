"""Scaling-law fits of a results table: the parametric L(N, D) and the isoFLOP minima.

The parametric fit is approach 3 of Hoffmann et al. (2022) as replicated by Besiroglu et al.
(2024); the isoFLOP fit is their approach 2. Both come with bootstrap intervals. docs/scaling.md,
"Collect and fit", gives the formulas, the optimiser settings and how the intervals are drawn.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import minimize

HUBER_DELTA = 1e-3
PARAMETERS = ("E", "A", "B", "alpha", "beta")
# The starting grid of Besiroglu et al. (2024), in (e, a, b, alpha, beta): 4,500 starts.
START_GRID = {
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}
DEFAULT_STARTS = 100
BOOTSTRAP_STARTS = 3
EXPONENT_MAX = 5.0
"""Upper bound of alpha and beta in the fit. Measured scaling exponents lie around 0.1-1; a fit
that runs to the bound has found a degenerate corner (a step-like term with a huge A or B that
over a few points fits as well as any), i.e. the data do not determine that exponent."""
REQUIRED_COLUMNS = ("family", "params", "tokens", "loss")
CI_LEVEL = 0.95


class ScalingFitError(ValueError):
    """Results that cannot be fitted; the message names the file, row, column or family."""


@dataclasses.dataclass
class FamilyData:
    """One family's runs: parameters N, tokens D, loss L, and (when known) FLOPs and budget labels."""

    family: str
    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    flops: np.ndarray | None
    budget: np.ndarray | None  # the nominal budget of each run (NaN where none), groups isoFLOP curves
    loss_unit: str = "loss"  # from a loss_unit column when the results have one


def _positive(value: str, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ScalingFitError(f"{where}: expected a positive number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ScalingFitError(f"{where}: expected a positive number, got {value!r}")
    return number


def load_results(path: str | Path, params_column: str = "params") -> dict[str, FamilyData]:
    """Read a results CSV (columns family, params, tokens, loss; flops and budget optional)."""
    path = Path(path)
    if not path.is_file():
        raise ScalingFitError(f"{path}: results file not found")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames or []
        needed = ["family", params_column, "tokens", "loss"]
        missing = [c for c in needed if c not in columns]
        if missing:
            raise ScalingFitError(
                f"{path}: missing column(s) {', '.join(missing)}; found {', '.join(columns) or 'none'}; "
                f"a results file needs at least {', '.join(needed)}"
            )
        rows: dict[str, list[tuple[float, float, float, float, float]]] = {}
        units: dict[str, str] = {}
        for line, row in enumerate(reader, start=2):
            where = f"{path}: line {line}"
            family = (row.get("family") or "").strip()
            if not family:
                raise ScalingFitError(f"{where}: column family: empty")
            n = _positive(row[params_column], f"{where}: column {params_column}")
            d = _positive(row["tokens"], f"{where}: column tokens")
            loss = _positive(row["loss"], f"{where}: column loss")
            c = _positive(row["flops"], f"{where}: column flops") if row.get("flops") not in (None, "") else math.nan
            b = _positive(row["budget"], f"{where}: column budget") if row.get("budget") not in (None, "") else math.nan
            rows.setdefault(family, []).append((n, d, loss, c, b))
            units[family] = (row.get("loss_unit") or "loss").replace("_", " ")
    if not rows:
        raise ScalingFitError(f"{path}: no rows")
    data = {}
    for family, values in rows.items():
        n, d, loss, c, b = (np.array(v) for v in zip(*values))
        data[family] = FamilyData(family, n, d, loss, None if np.isnan(c).any() else c,
                                  None if np.isnan(b).all() else b, units[family])
    return data


# ----------------------------------------------------------------------------- the parametric fit


def _huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                     delta: float) -> tuple[float, np.ndarray]:
    """Sum of Huber losses of log-space residuals, and its gradient in (e, a, b, alpha, beta)."""
    e, a, b, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    residual = top + np.log(total) - log_l
    weights /= total
    small = np.abs(residual) <= delta
    loss = np.where(small, 0.5 * residual**2, delta * (np.abs(residual) - 0.5 * delta)).sum()
    slope = np.where(small, residual, delta * np.sign(residual))
    grad = np.array([
        (slope * weights[2]).sum(),
        (slope * weights[0]).sum(),
        (slope * weights[1]).sum(),
        -(slope * weights[0] * log_n).sum(),
        -(slope * weights[1] * log_d).sum(),
    ])
    return float(loss), grad


def _grid_objective(starts: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                    delta: float) -> np.ndarray:
    """The Huber objective at every start at once ([S, 5] -> [S])."""
    e, a, b, alpha, beta = (starts[:, i : i + 1] for i in range(5))
    predicted = np.logaddexp(np.logaddexp(a - alpha * log_n, b - beta * log_d), e)
    residual = np.abs(predicted - log_l)
    return np.where(residual <= delta, 0.5 * residual**2, delta * (residual - 0.5 * delta)).sum(axis=1)


def _minimise(start: np.ndarray, args: tuple) -> tuple[float, np.ndarray]:
    """Exponents are kept in [0, EXPONENT_MAX]: a negative one would make loss grow with size or
    data, and without an upper bound a degenerate fit's A or B can pass float64's range."""
    bounds = [(None, None), (None, None), (None, None), (0.0, EXPONENT_MAX), (0.0, EXPONENT_MAX)]
    result = minimize(_huber_objective, start, args=args, jac=True, method="L-BFGS-B", bounds=bounds,
                      options={"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-9})
    return float(result.fun), result.x


def _fit_from(starts: list[np.ndarray], log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
              delta: float) -> list[tuple[float, np.ndarray]]:
    """Every start's local optimum, best first."""
    args = (log_n, log_d, log_l, delta)
    return sorted((_minimise(s, args) for s in starts), key=lambda r: r[0])


def _as_constants(theta: np.ndarray) -> dict[str, float]:
    e, a, b, alpha, beta = theta
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": float(alpha), "beta": float(beta),
            "a": float(beta / (alpha + beta)) if alpha + beta > 0 else math.nan,
            "b": float(alpha / (alpha + beta)) if alpha + beta > 0 else math.nan}


def _interval(samples: np.ndarray) -> list[float]:
    tail = 100 * (1 - CI_LEVEL) / 2
    return [float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail))]


def fit_parametric(n: np.ndarray, d: np.ndarray, loss: np.ndarray, bootstrap: int = 200, seed: int = 0,
                   starts: int | None = DEFAULT_STARTS, grid: dict[str, tuple[float, ...]] = START_GRID,
                   delta: float = HUBER_DELTA) -> dict[str, Any]:
    """E, A, B, alpha, beta of L(N, D) = E + A/N^alpha + B/D^beta, with bootstrap intervals
    (keys of "ci"; "a" and "b" are the implied compute-optimal exponents beta/(alpha+beta) and
    alpha/(alpha+beta))."""
    if len(n) < len(PARAMETERS):
        raise ScalingFitError(f"{len(n)} points: the parametric fit has {len(PARAMETERS)} parameters; "
                              f"it needs at least {len(PARAMETERS)} runs (more, in practice)")
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    points = np.array(list(itertools.product(*(grid[k] for k in ("e", "a", "b", "alpha", "beta")))), dtype=float)
    if starts is not None:
        points = points[np.argsort(_grid_objective(points, log_n, log_d, log_l, delta), kind="stable")[:starts]]
    optima = _fit_from(list(points), log_n, log_d, log_l, delta)
    best_value, best = optima[0]
    seeds = [best]
    for _, theta in optima[1:]:  # a few distinct local optima as the bootstrap's starting points
        if len(seeds) == BOOTSTRAP_STARTS:
            break
        if all(np.abs(theta - s).max() > 1e-3 for s in seeds):
            seeds.append(theta)
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
        pick = rng.integers(0, len(n), len(n))
        _, theta = _fit_from(seeds, log_n[pick], log_d[pick], log_l[pick], delta)[0]
        samples.append(_as_constants(theta))
    out: dict[str, Any] = _as_constants(best)
    out["objective"] = best_value
    out["n_points"] = len(n)
    out["at_bound"] = [k for k in ("alpha", "beta") if out[k] >= EXPONENT_MAX - 1e-6]
    out["ci"] = {k: _interval(np.array([s[k] for s in samples])) for k in out if k in samples[0]} if samples else {}
    residuals = np.log(predict_loss(out, n, d)) - log_l
    out["rms_log_residual"] = float(np.sqrt(np.mean(residuals**2)))
    return out


def predict_loss(constants: dict[str, float], n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """L(N, D) from fitted constants."""
    c = constants
    return c["E"] + c["A"] / np.asarray(n, float) ** c["alpha"] + c["B"] / np.asarray(d, float) ** c["beta"]


def optimal_allocation(
    fit: dict[str, Any], flops: np.ndarray, flops_per_param_token: float
) -> tuple[np.ndarray, np.ndarray]:
    """N*(C), D*(C) minimising the fitted L(N, D) subject to C = k N D (k: FLOPs per parameter per token)."""
    alpha, beta, a, b = fit["alpha"], fit["beta"], fit["A"], fit["B"]
    g = (alpha * a / (beta * b)) ** (1 / (alpha + beta))
    scaled = flops / flops_per_param_token
    n_opt = g * scaled ** (beta / (alpha + beta))
    return n_opt, scaled / n_opt


# ----------------------------------------------------------------------------- isoFLOP minima


def budget_groups(data: FamilyData) -> dict[float, np.ndarray]:
    """Indices of the runs of each compute budget (the nominal budget, else FLOPs to 2 digits)."""
    if data.budget is not None and not np.isnan(data.budget).any():
        keys = data.budget
    elif data.flops is not None:
        keys = np.array([float(f"{c:.2g}") for c in data.flops])
    else:
        return {}
    return {float(k): np.flatnonzero(keys == k) for k in np.unique(keys)}


def _parabola_minimum(x: np.ndarray, loss: np.ndarray) -> tuple[float, float, bool] | None:
    """(x at the minimum, loss there, whether the minimum lies outside the sampled x) of a
    quadratic fit, or None when the points do not locate one: fewer than 3 distinct x, a parabola
    that is not convex, or a vertex further beyond the sampled x than their whole span (a nearly
    flat curve, whose vertex can land anywhere)."""
    if len(np.unique(x)) < 3:
        return None
    c2, c1, c0 = np.polyfit(x, loss, 2)
    if c2 <= 0:
        return None
    x_min = -c1 / (2 * c2)
    span = x.max() - x.min()
    if not x.min() - span <= x_min <= x.max() + span:
        return None
    return float(x_min), float(c0 + c1 * x_min + c2 * x_min**2), bool(x_min < x.min() or x_min > x.max())


def _minima(data: FamilyData, groups: dict[float, np.ndarray]) -> list[dict[str, Any]]:
    rows = []
    for budget, idx in sorted(groups.items()):
        on_n = _parabola_minimum(np.log(data.params[idx]), data.loss[idx])
        on_d = _parabola_minimum(np.log(data.tokens[idx]), data.loss[idx])
        if on_n is None or on_d is None:
            continue
        rows.append({"flops": budget, "N_opt": math.exp(on_n[0]), "D_opt": math.exp(on_d[0]), "loss_opt": on_n[1],
                     "at_edge": on_n[2] or on_d[2], "n_runs": len(idx)})
    return rows


def _power_law(budgets: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """(exponent, prefactor) of values = k * budgets^exponent, least squares in log-log space."""
    slope, intercept = np.polyfit(np.log(budgets), np.log(values), 1)
    return float(slope), float(math.exp(intercept))


def fit_isoflop(data: FamilyData, bootstrap: int = 200, seed: int = 0) -> dict[str, Any]:
    """Per-budget minima and the exponents of N*(C) and D*(C); a "skipped" reason when they cannot
    be fitted (no FLOPs/budget column, fewer than 3 runs per budget, fewer than 2 usable budgets)."""
    groups = budget_groups(data)
    if not groups:
        return {"skipped": "no flops or budget column to group runs into isoFLOP curves"}
    minima = _minima(data, groups)
    if len(minima) < 2:
        return {"skipped": f"{len(minima)} budget(s) with a convex parabola through >= 3 model sizes; need 2",
                "minima": minima}
    c = np.array([m["flops"] for m in minima])
    a, a_k = _power_law(c, np.array([m["N_opt"] for m in minima]))
    b, b_k = _power_law(c, np.array([m["D_opt"] for m in minima]))
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
        resampled = {k: rng.choice(idx, len(idx)) for k, idx in groups.items()}
        m = _minima(data, resampled)
        if len(m) >= 2:
            cs = np.array([r["flops"] for r in m])
            samples.append((_power_law(cs, np.array([r["N_opt"] for r in m]))[0],
                            _power_law(cs, np.array([r["D_opt"] for r in m]))[0]))
    out = {"minima": minima, "N_exponent": a, "N_prefactor": a_k, "D_exponent": b, "D_prefactor": b_k,
           "n_budgets": len(minima), "any_at_edge": any(m["at_edge"] for m in minima)}
    if samples:
        arr = np.array(samples)
        out["ci"] = {"N_exponent": _interval(arr[:, 0]), "D_exponent": _interval(arr[:, 1])}
        out["bootstrap_valid"] = len(samples) / bootstrap
    return out


# ----------------------------------------------------------------------------- every family


def fit_results(data: dict[str, FamilyData], bootstrap: int = 200, seed: int = 0,
                starts: int | None = DEFAULT_STARTS) -> dict[str, dict[str, Any]]:
    """fit.json's content: per family the parametric constants with "ci", "n_points", and "isoflop"."""
    fits = {}
    for family, fd in data.items():
        try:
            fit = fit_parametric(fd.params, fd.tokens, fd.loss, bootstrap=bootstrap, seed=seed, starts=starts)
        except ScalingFitError as err:
            raise ScalingFitError(f"family {family}: {err}") from None
        if fd.flops is not None:
            fit["flops_per_param_token"] = float(np.median(fd.flops / (fd.params * fd.tokens)))
        fit["isoflop"] = fit_isoflop(fd, bootstrap=bootstrap, seed=seed)
        fits[family] = fit
    return fits


def _with_ci(fit: dict[str, Any], key: str, ci: dict[str, list[float]] | None = None) -> str:
    ci = fit.get("ci", {}) if ci is None else ci
    value = fit[key]
    if key in ci:
        lo, hi = ci[key]
        return f"{value:.3g} [{lo:.3g}, {hi:.3g}]"
    return f"{value:.3g}"


def format_fit(fits: dict[str, dict[str, Any]]) -> str:
    """Markdown tables: the parametric constants, then the compute-optimal exponents (95% intervals)."""
    lines = ["| family | runs | E | A | B | alpha | beta | rms log residual |", "|---|---:|---|---|---|---|---|---:|"]
    for family, fit in fits.items():
        bound = "".join(f" ({k} at its bound {EXPONENT_MAX:g}: not determined)" for k in fit.get("at_bound", []))
        lines.append(f"| {family}{bound} | {fit['n_points']} | " + " | ".join(_with_ci(fit, k) for k in PARAMETERS)
                     + f" | {fit['rms_log_residual']:.4f} |")
    lines += [
        "",
        "| family | N* ~ C^a (parametric) | D* ~ C^b (parametric) | N* ~ C^a (isoFLOP) | D* ~ C^b (isoFLOP) "
        "| budgets |",
        "|---|---|---|---|---|---:|",
    ]
    for family, fit in fits.items():
        iso = fit["isoflop"]
        if "skipped" in iso:
            iso_cells = f"skipped: {iso['skipped']} | - | 0"
        else:
            edge = " (a minimum at the edge)" if iso["any_at_edge"] else ""
            iso_cells = (f"{_with_ci(iso, 'N_exponent', iso.get('ci', {}))} | "
                         f"{_with_ci(iso, 'D_exponent', iso.get('ci', {}))} | {iso['n_budgets']}{edge}")
        lines.append(f"| {family} | {_with_ci(fit, 'a')} | {_with_ci(fit, 'b')} | {iso_cells} |")
    return "\n".join(lines)
