"""Shared decay nodes and the per-order coefficients fitted on them (docs/soe.md, "Nodes" and "Fit")."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from model.soe.weights import gl_weights

# Minimax refinement (Lawson) per fitted order: at most this many rounds, stopping early once the
# max error has not dropped by 1% for _LAWSON_PATIENCE rounds.
_LAWSON_ITERS = 60
_LAWSON_PATIENCE = 8
# Candidate placements of the geometric rate grid: smallest rate = lo / T, largest rate = hi.
# The first of each is the default.
_NODE_LO = (0.3, 0.15)
_NODE_HI = (7.0, 5.0, 10.0)
# Fitting sample: every n <= _FIT_HEAD plus _FIT_DENSE log-spaced lags up to T.
_FIT_HEAD = 63
_FIT_DENSE = 400


def design_nodes(T: int, num_decaying: int, lo: float = 0.3, hi: float = 7.0) -> np.ndarray:
    """Shared log-decays: ``num_decaying`` geometric rates in [lo/T, hi] plus the alpha = 1 node.

    Returns log_lambda (float64, ascending, last entry exactly 0.0).  Geometric rates are the
    trapezoidal rule of the Laplace integral after t = exp(x); the smallest rate (~lo/T) is the
    tail term: for n <= T every rate << 1/T looks like the same near-constant function, so one
    slowly decaying exponential carries the whole small-t mass that a truncated quadrature misses.
    The largest rate (lambda ~ exp(-hi)) is nearly zero after one step and absorbs the n = 0 weight.
    """
    if num_decaying < 1 or T < 1:
        raise ValueError("need T >= 1 and at least one decaying node")
    rates = np.geomspace(lo / T, hi, num_decaying) if num_decaying > 1 else np.array([lo / T])
    return np.concatenate([np.sort(-rates), [0.0]])


def quadrature_coefficients(log_lambda: np.ndarray, alpha: float, tail: bool = True) -> np.ndarray:
    """Coefficients straight from the trapezoidal rule of the Laplace integral (no fitting).

    w_n = sin(pi a)/pi * int_0^inf exp(-t (n + a)) (1 - exp(-t))^(-a) dt; with t = exp(x) and the
    geometric rates r_s of ``design_nodes`` (log-step h), c_s = sin(pi a)/pi * h r_s exp(-r_s a)
    (1 - exp(-r_s))^(-a).  With ``tail`` the mass left of the grid, int_0^{t_L} t^(-a) dt with
    t_L = r_min exp(-h/2), is added to the slowest node.  This is the baseline the fit improves on
    (docs/soe.md compares them); it does not reproduce w_0 = 1, and alpha = 1 gives the exact unit
    vector on the lambda = 1 node.
    """
    log_lambda = np.asarray(log_lambda, dtype=np.float64)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    decaying = np.flatnonzero(log_lambda < 0.0)
    coef = np.zeros_like(log_lambda)
    if alpha == 1.0:
        coef[log_lambda == 0.0] = 1.0
        return coef
    rates = -log_lambda[decaying]
    steps = np.diff(np.log(np.sort(rates)))
    if rates.size < 2 or not np.allclose(steps, steps[0], rtol=1e-9):
        raise ValueError("quadrature coefficients need at least two geometrically spaced rates")
    h = float(steps[0])
    scale = math.sin(math.pi * alpha) / math.pi
    coef[decaying] = scale * h * rates * np.exp(-rates * alpha) * (-np.expm1(-rates)) ** (-alpha)
    if tail:
        slowest = decaying[np.argmin(rates)]
        t_left = rates.min() * math.exp(-h / 2)
        coef[slowest] += scale * t_left ** (1.0 - alpha) / (1.0 - alpha)
    return coef


@functools.lru_cache(maxsize=64)
def _fit_sample_cached(T: int) -> np.ndarray:
    dense = np.round(np.geomspace(1.0, float(T), _FIT_DENSE))
    return np.unique(np.concatenate([np.arange(min(T, _FIT_HEAD) + 1), dense])).astype(np.float64)


def _fit_sample(T: int) -> np.ndarray:
    """Lags the coefficients are fitted on: n = 0..63 and a dense log-spaced sample up to T.

    Memoised (a fresh copy each call, so callers may write to it): the node search asks for it
    once per trial fit.
    """
    return _fit_sample_cached(int(T)).copy()


def fit_coefficients(log_lambda: np.ndarray, alpha: float, T: int) -> np.ndarray:
    """Coefficients c_s(alpha) on shared nodes, minimising the max relative error over n in [0, T].

    alpha = 1 returns the exact unit vector on the lambda = 1 node, whatever the other nodes (also
    when lambda = 1 is the only node).  For alpha < 1 the lambda = 1 coefficient is 0 (the kernel
    decays to zero beyond any horizon) and the rest solve an equality-constrained least-squares
    problem on the relative residual (sum_s c_s = 1, i.e. w_0 = 1 exactly), re-weighted by Lawson's
    rule towards the minimax solution (until it stalls); the best iterate on the fitting sample is
    returned.  An order below 1 needs at least one decaying node (ValueError otherwise).

    Results are memoised per (nodes, alpha, T): the node search and ``certify`` fit the same order
    on the same nodes several times, and each fit is tens of least-squares solves.
    """
    log_lambda = np.asarray(log_lambda, dtype=np.float64)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    if log_lambda.ndim != 1:
        raise ValueError("log_lambda must be 1-D")
    return _fit_cached(log_lambda.tobytes(), float(alpha), int(T)).copy()


@functools.lru_cache(maxsize=4096)
def _fit_cached(nodes_bytes: bytes, alpha: float, T: int) -> np.ndarray:
    """The fit itself (see ``fit_coefficients``), keyed by the raw bytes of the node array."""
    log_lambda = np.frombuffer(nodes_bytes, dtype=np.float64)
    one = np.flatnonzero(log_lambda == 0.0)
    if one.size != 1:
        raise ValueError("the node set must contain exactly one lambda = 1 node (log_lambda = 0)")
    coef = np.zeros_like(log_lambda)
    if alpha == 1.0:
        coef[one] = 1.0
        coef.flags.writeable = False
        return coef
    decaying = np.flatnonzero(log_lambda < 0.0)
    if decaying.size == 0:
        raise ValueError(f"alpha={alpha} < 1 needs at least one decaying node (log_lambda < 0)")
    n = _fit_sample(T)
    rel = np.exp(np.outer(n, log_lambda[decaying])) / gl_weights(n, alpha)[:, None]
    m = decaying.size
    # Null-space parametrisation of sum(c) = 1: c = ones/m + basis @ z.
    q, _ = np.linalg.qr(np.ones((m, 1)), mode="complete")
    basis = q[:, 1:]
    base = np.full(m, 1.0 / m)
    lhs = rel @ basis
    rhs = 1.0 - rel @ base
    weight = np.full(n.size, 1.0 / n.size)
    best_err, best, since_gain = np.inf, base, 0
    for _ in range(_LAWSON_ITERS if m > 1 else 0):  # one decaying node: sum(c) = 1 fixes it
        root = np.sqrt(weight)
        z = np.linalg.lstsq(root[:, None] * lhs, root * rhs, rcond=None)[0]
        c = base + basis @ z
        err = np.abs(rel @ c - 1.0)
        since_gain = 0 if err.max() < 0.99 * best_err else since_gain + 1
        if err.max() < best_err:
            best_err, best = float(err.max()), c
        if since_gain >= _LAWSON_PATIENCE:
            break
        weight = weight * err
        total = weight.sum()
        if total == 0.0:
            break
        weight /= total
    coef[decaying] = best
    coef.flags.writeable = False
    return coef


def bank_coefficients(alphas: Sequence[float] | np.ndarray, log_lambda: np.ndarray, T: int) -> np.ndarray:
    """Coefficients for every order in ``alphas`` on the shared nodes: array [K, S] (float64)."""
    rows = [fit_coefficients(log_lambda, float(a), T) for a in np.asarray(alphas, dtype=np.float64)]
    return np.stack(rows) if rows else np.empty((0, np.size(log_lambda)))
