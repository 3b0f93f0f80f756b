"""Proposition 4.2, numerically: fits by exponentials whose decay rates are bounded below cannot follow
w_n(alpha), alpha > 1/2, as T grows (an achievable M-term fit above, a grid-span bound below)."""

from __future__ import annotations

import math

import numpy as np

from model.soe.weights import gl_weights


def _ls_residual(basis: np.ndarray, target: np.ndarray) -> float:
    coef = np.linalg.lstsq(basis, target, rcond=None)[0]
    return float(np.linalg.norm(basis @ coef - target))


def span_fit_error(alpha: float, T: int, rate_min: float = 1e-3, rate_max: float = 20.0,
                   grid: int = 160) -> float:
    """L2 error over n = 1..T of the best fit of w_n(alpha) by any signed combination of ``grid``
    exponentials exp(-r n) with rates r log-spaced in [rate_min, rate_max] (Proposition 4.2).

    Every mixture whose rates lie on the grid is in this span, whatever its number of terms, so this
    is a lower bound on their errors (up to the grid's resolution of the admissible rates).
    """
    n = np.arange(1, T + 1, dtype=np.float64)
    return _ls_residual(np.exp(-np.outer(n, np.geomspace(rate_min, rate_max, grid))), gl_weights(n, alpha))


def m_term_fit_error(alpha: float, T: int, M: int = 5, rate_min: float = 1e-3, sweeps: int = 6) -> float:
    """L2 error over n = 1..T of an optimised fit of w_n(alpha) by M exponentials with rates >= rate_min.

    Variable projection: least-squares coefficients for given rates, log-rates refined by a
    coordinate search (halving steps) from a geometric start on [rate_min, 1].  An achievable fit,
    hence an upper bound on the best M-term error (Proposition 4.2).
    """
    n = np.arange(1, T + 1, dtype=np.float64)
    target = gl_weights(n, alpha)

    def residual(log_rates: np.ndarray) -> float:
        return _ls_residual(np.exp(-np.outer(n, np.exp(log_rates))), target)

    floor = math.log(rate_min)
    log_rates = np.log(np.geomspace(rate_min, 1.0, M))
    best = residual(log_rates)
    step = 1.0
    for _ in range(sweeps):
        for i in range(M):
            for move in (-step, step):
                trial = log_rates.copy()
                trial[i] = max(trial[i] + move, floor)
                value = residual(trial)
                if value < best:
                    best, log_rates = value, trial
        step *= 0.5
    return best
