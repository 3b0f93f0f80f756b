"""Certified sum-of-exponentials (SOE) form of the Grünwald–Letnikov power-law kernel.

The VORT layer weights a token at lag n with w_n(alpha) = Gamma(n+alpha) / (Gamma(alpha) Gamma(n+1)).
A pure power law has no finite recurrence, so the layer replaces it by

    w_n(alpha) ~= sum_s coef_s(alpha) * lambda_s**n,    lambda_s = exp(log_lambda_s),

where the decays lambda_s are *shared by every order* (only coef depends on alpha): then a token's
order is folded into its write and the recurrent state is S x d_phi x d_v per head whatever the
number of banks.  This module builds such kernels and certifies them:

* ``gl_weights``: the exact float64 reference (lgamma), including the limits alpha = 1 and alpha = 0.
* ``design_nodes`` / ``fit_coefficients``: nodes on a geometric grid of decay rates (the
  trapezoidal rule of the Laplace integral in x = log t) that reaches down to rates ~ 1/T, so the
  smallest rate carries the small-t tail; coefficients fitted per order by equality-constrained
  minimax (Lawson) least squares on the relative error, with w_0 = 1 reproduced exactly
  (``quadrature_coefficients`` is the unfitted trapezoidal baseline).  The node
  set always contains lambda = 1 (log_lambda = 0): its coefficient is 1 for alpha = 1 (exact running
  sum) and 0 for every alpha < 1.
* ``certify`` / ``build_kernel``: choose the smallest S meeting eps on an alpha range and measure the
  maximum relative error over *every* n in [0, T] against the reference.
* ``interpolate_coefficients``: differentiable linear interpolation between neighbouring banks
  (torch), and ``bank_layout_error`` / ``equidistributed_banks`` for the quantisation error of a
  bank layout (the paper's Theorem 4.1).
* ``span_fit_error`` / ``m_term_fit_error``: the numeric side of Proposition 4.2 (fits by exponentials whose decay
  rates are bounded below cannot follow w_n(alpha), alpha > 1/2, as T grows).

Command line (shape relied on by tools outside the project)::

    python -m model.soe --T 524288 --eps 1e-3 --alpha 0.2 --alpha 0.5 --alpha 0.95 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Default alpha range certified by the command line and ``build_kernel`` (the target range).
DEFAULT_ALPHA_RANGE = (0.1, 0.95)
# Number of lags evaluated at once when measuring errors over every n in [0, T] (bounds memory).
_CHUNK = 1 << 16
# Minimax refinement (Lawson) per fitted order: at most this many rounds, stopping early once the
# max error has not dropped by 1% for _LAWSON_PATIENCE rounds (it settles within 20-30 rounds).
_LAWSON_ITERS = 60
_LAWSON_PATIENCE = 8
# Candidate placements of the geometric rate grid: smallest rate = lo / T, largest rate = hi.
# The first of each is the default (best in most settings measured).
_NODE_LO = (0.3, 0.15)
_NODE_HI = (7.0, 5.0, 10.0)
# Orders used to choose the nodes inside an alpha range (the smallest order is the hardest).
_DESIGN_POINTS = 9


def gl_weights(n: np.ndarray | Sequence[float] | float, alpha: np.ndarray | Sequence[float] | float) -> np.ndarray:
    """Exact Grünwald–Letnikov weights w_n(alpha) in float64, broadcasting ``n`` against ``alpha``.

    Computed as exp(lgamma(n+alpha) - lgamma(alpha) - lgamma(n+1)) so that no product of ratios
    accumulates rounding over long lags (the lgamma difference loses about log10(n log n) digits:
    relative accuracy ~1e-9 at n ~ 5e5, far below any eps used here).  alpha = 1 gives exactly 1
    for every n; alpha = 0 gives the limit (1, 0, 0, ...); n = 0 gives exactly 1 for every alpha.
    """
    n_arr = np.asarray(n, dtype=np.float64)
    a_arr = np.asarray(alpha, dtype=np.float64)
    if np.any(n_arr < 0) or np.any(a_arr < 0):
        raise ValueError("gl_weights needs n >= 0 and alpha >= 0")
    positive = a_arr > 0
    nt = torch.as_tensor(n_arr)
    at = torch.as_tensor(a_arr if positive.all() else np.where(positive, a_arr, 1.0))
    # lgamma of the broadcast sum only; the n-only and alpha-only terms are computed once each.
    # At n = 0 the exponent is exactly lgamma(a) - lgamma(a) - lgamma(1) = 0, so w_0 = 1 exactly.
    w = torch.exp(torch.lgamma(nt + at) - torch.lgamma(at) - torch.lgamma(nt + 1.0))
    if not positive.all():
        w = torch.where(torch.as_tensor(positive), w, (nt == 0).to(w.dtype))
    return w.numpy()


def soe_weights(log_lambda: np.ndarray, coef: np.ndarray, n: np.ndarray | Sequence[float]) -> np.ndarray:
    """Evaluate the SOE kernel sum_s coef[..., s] * lambda_s**n; returns shape coef.shape[:-1] + n.shape."""
    powers = np.exp(np.multiply.outer(np.asarray(n, dtype=np.float64), np.asarray(log_lambda, dtype=np.float64)))
    return np.tensordot(np.asarray(coef, dtype=np.float64), powers, axes=([-1], [-1]))


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


def _fit_sample(T: int) -> np.ndarray:
    """Lags the coefficients are fitted on: n = 0..63 and a dense log-spaced sample up to T."""
    dense = np.round(np.geomspace(1.0, float(T), 400))
    return np.unique(np.concatenate([np.arange(min(T, 63) + 1), dense])).astype(np.float64)


def fit_coefficients(log_lambda: np.ndarray, alpha: float, T: int) -> np.ndarray:
    """Coefficients c_s(alpha) on shared nodes, minimising the max relative error over n in [0, T].

    alpha = 1 returns the exact unit vector on the lambda = 1 node.  For alpha < 1 the lambda = 1
    coefficient is 0 (the kernel decays to zero beyond any horizon) and the rest solve an
    equality-constrained least-squares problem on the relative residual (sum_s c_s = 1, i.e.
    w_0 = 1 exactly), re-weighted by Lawson's rule towards the minimax solution (until it stalls); the best iterate
    on the fitting sample is returned.
    """
    log_lambda = np.asarray(log_lambda, dtype=np.float64)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    one = np.flatnonzero(log_lambda == 0.0)
    if one.size != 1:
        raise ValueError("the node set must contain exactly one lambda = 1 node (log_lambda = 0)")
    coef = np.zeros_like(log_lambda)
    if alpha == 1.0:
        coef[one] = 1.0
        return coef
    decaying = np.flatnonzero(log_lambda < 0.0)
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
    for _ in range(_LAWSON_ITERS):
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
    return coef


def bank_coefficients(alphas: Sequence[float] | np.ndarray, log_lambda: np.ndarray, T: int) -> np.ndarray:
    """Coefficients for every order in ``alphas`` on the shared nodes: array [K, S] (float64)."""
    rows = [fit_coefficients(log_lambda, float(a), T) for a in np.asarray(alphas, dtype=np.float64)]
    return np.stack(rows) if rows else np.empty((0, np.size(log_lambda)))


def max_relative_error(log_lambda: np.ndarray, coef: np.ndarray, alphas: Sequence[float] | np.ndarray,
                       T: int) -> np.ndarray:
    """Max over every integer n in [0, T] of |soe - w_n(alpha)| / w_n(alpha), one value per order.

    ``coef`` is [K, S] aligned with ``alphas``.  All T + 1 lags are evaluated (in chunks), so this is
    a measurement, not an estimate from a sample.
    """
    alphas = np.asarray(alphas, dtype=np.float64)
    coef = np.atleast_2d(np.asarray(coef, dtype=np.float64))
    log_lambda = np.asarray(log_lambda, dtype=np.float64)
    # lambda**(start + j) = lambda**j * lambda**start: one table of powers serves every chunk, and the
    # chunk offset is folded into the coefficients (all factors <= 1, no division).
    table = np.exp(np.arange(min(_CHUNK, T + 1), dtype=np.float64)[:, None] * log_lambda)
    worst = np.zeros(alphas.size)
    for start in range(0, T + 1, _CHUNK):
        n = np.arange(start, min(T + 1, start + _CHUNK), dtype=np.float64)
        approx = table[: n.size] @ (coef * np.exp(start * log_lambda)).T
        exact = gl_weights(n[:, None], alphas[None, :])
        worst = np.maximum(worst, np.max(np.abs(approx - exact) / exact, axis=0))
    return worst


@dataclass(frozen=True)
class SOEKernel:
    """What the VORT layer consumes: shared log-decays, per-bank coefficients and the bank orders.

    log_lambda: [S] float64, ascending, <= 0, last entry 0.0 (the lambda = 1 node used by alpha = 1).
    coef: [K, S] float64, row k gives w_n(banks[k]) ~= sum_s coef[k, s] * exp(n * log_lambda[s]).
    banks: [K] float64, increasing orders in (0, 1].
    """

    log_lambda: np.ndarray
    coef: np.ndarray
    banks: np.ndarray

    @property
    def S(self) -> int:
        """Number of SOE terms (recurrent states per head)."""
        return int(self.log_lambda.size)

    def weights(self, n: np.ndarray | Sequence[float]) -> np.ndarray:
        """SOE kernel of every bank at lags ``n``: [K, len(n)]."""
        return soe_weights(self.log_lambda, self.coef, np.asarray(n, dtype=np.float64))

    def as_tensors(self, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_lambda [S], coef [K, S], banks [K]) as torch tensors, e.g. for register_buffer."""
        return tuple(torch.as_tensor(x, dtype=dtype, device=device)
                     for x in (self.log_lambda, self.coef, self.banks))


@dataclass(frozen=True)
class Certificate:
    """Result of ``certify``: the kernel plus the measured error that backs it.

    rel_err[k] is the max relative error of bank k over every n in [0, T]; design_err is the same
    measure at the orders used to choose the nodes (an even grid on alpha_range).
    """

    kernel: SOEKernel
    T: int
    eps: float
    alpha_range: tuple[float, float]
    rel_err: np.ndarray
    design_err: float

    @property
    def S(self) -> int:
        """Number of SOE terms, the lambda = 1 node included."""
        return self.kernel.S

    @property
    def max_rel_err(self) -> float:
        """Max relative error over the requested orders and every n in [0, T]."""
        return float(self.rel_err.max()) if self.rel_err.size else 0.0


def _design_alphas(alpha_range: tuple[float, float]) -> np.ndarray:
    """Evenly spaced orders below 1 on the range (empty when the range is just alpha = 1)."""
    lo, hi = alpha_range
    if lo >= 1.0:
        return np.empty(0)
    return np.unique(np.linspace(lo, min(hi, 1.0 - 1e-9), _DESIGN_POINTS))


def _sample_error(log_lambda: np.ndarray, alpha: float, T: int) -> float:
    """Max relative error of the fitted kernel on the fitting sample (cheap screen before certifying)."""
    n = _fit_sample(T)
    c = fit_coefficients(log_lambda, alpha, T)
    return float(np.max(np.abs(soe_weights(log_lambda, c, n) / gl_weights(n, alpha) - 1.0)))


def choose_nodes(T: int, eps: float, alpha_range: tuple[float, float] = DEFAULT_ALPHA_RANGE,
                 max_terms: int = 96) -> np.ndarray:
    """Smallest shared node set whose fitted kernels meet ``eps`` on the fitting sample for the range.

    Doubling then bisection on the number of decaying nodes, with the default grid placement and
    the smallest order of the range (the hardest one in practice); then, from one node fewer than
    that, every candidate placement is checked on an even grid of orders, adding nodes until one
    passes for every order.  Raises ValueError when ``max_terms`` are not enough.
    """
    lo_alpha, hi_alpha = alpha_range
    if not 0.0 < lo_alpha <= hi_alpha <= 1.0:
        raise ValueError(f"alpha range must satisfy 0 < lo <= hi <= 1, got {alpha_range}")
    fitted = _design_alphas(alpha_range)
    if fitted.size == 0:
        return np.array([0.0])
    target = 0.9 * eps

    def passes_hardest(m: int) -> bool:
        return _sample_error(design_nodes(T, m, _NODE_LO[0], _NODE_HI[0]), fitted[0], T) <= target

    left, right = 1, 4
    while not passes_hardest(right):
        if right >= max_terms - 1:
            raise ValueError(f"no SOE kernel with <= {max_terms} terms meets eps={eps} for T={T}")
        left, right = right + 1, min(2 * right, max_terms - 1)
    while left < right:
        mid = (left + right) // 2
        if passes_hardest(mid):
            right = mid
        else:
            left = mid + 1
    for m in range(max(1, left - 1), max_terms):
        for lo in _NODE_LO:
            for hi in _NODE_HI:
                nodes = design_nodes(T, m, lo, hi)
                if all(_sample_error(nodes, a, T) <= target for a in fitted):
                    return nodes
    raise ValueError(f"no SOE kernel with <= {max_terms} terms meets eps={eps} for T={T}")


def certify(T: int, eps: float, alphas: Sequence[float] | np.ndarray | None = None,
            alpha_range: tuple[float, float] = DEFAULT_ALPHA_RANGE, max_terms: int = 96) -> Certificate:
    """Choose the smallest S meeting ``eps`` and measure the error over every n in [0, T].

    The nodes are designed for ``alpha_range`` widened to contain every requested order below 1,
    so one node set serves them all.  The design orders are certified over all lags too, and S is
    increased until both they and the requested orders (default: the design orders) meet eps.
    """
    if T < 1 or eps <= 0:
        raise ValueError("need T >= 1 and eps > 0")
    requested = None if alphas is None else np.asarray(alphas, dtype=np.float64)
    lo, hi = alpha_range
    if requested is not None and requested.size:
        if np.any(requested <= 0) or np.any(requested > 1):
            raise ValueError("orders must lie in (0, 1]")
        below_one = requested[requested < 1.0]
        if below_one.size:
            lo, hi = min(lo, float(below_one.min())), max(hi, float(below_one.max()))
    design = _design_alphas((lo, hi))
    nodes = choose_nodes(T, eps, (lo, hi), max_terms)
    while True:
        design_coef = bank_coefficients(design, nodes, T)
        design_rel = max_relative_error(nodes, design_coef, design, T)
        design_err = float(design_rel.max(initial=0.0))
        if requested is None:
            banks, coef, rel = design, design_coef, design_rel
        else:
            banks, coef = requested, bank_coefficients(requested, nodes, T)
            rel = max_relative_error(nodes, coef, banks, T)
        if max(design_err, float(rel.max(initial=0.0))) <= eps:
            return Certificate(SOEKernel(nodes, coef, banks), T, eps, (lo, hi), rel, design_err)
        if nodes.size >= max_terms:
            raise ValueError(f"no SOE kernel with <= {max_terms} terms meets eps={eps} for T={T}")
        # The sample screen passed but a lag between samples did not: one more decaying node
        # (nodes.size counts the lambda = 1 node, so this is the current decaying count + 1).
        nodes = min((design_nodes(T, nodes.size, a, b) for a in _NODE_LO for b in _NODE_HI),
                    key=lambda nd: max(_sample_error(nd, a, T) for a in design))


def build_kernel(banks: Sequence[float] | np.ndarray, T: int, eps: float = 1e-3) -> Certificate:
    """Certified SOE kernel for the given bank orders (the layer's constructor entry point)."""
    banks = np.asarray(banks, dtype=np.float64)
    if banks.ndim != 1 or banks.size == 0 or np.any(np.diff(banks) <= 0):
        raise ValueError("banks must be a non-empty increasing 1-D sequence")
    below_one = banks[banks < 1.0]
    rng = (float(below_one.min()), float(below_one.max())) if below_one.size else (1.0, 1.0)
    return certify(T, eps, banks, alpha_range=rng)


def interpolate_coefficients(alpha: torch.Tensor, banks: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Per-token coefficients by linear interpolation between the two neighbouring banks.

    alpha: [...] orders (clamped to [banks[0], banks[-1]]); banks: [K] increasing; coef: [K, S].
    Returns [..., S].  Differentiable in alpha (piecewise linear) and in coef; the interpolated
    kernel is the same linear blend of the two bank kernels, which is what ``bank_layout_error``
    measures.
    """
    a = alpha.clamp(banks[0], banks[-1])
    if banks.numel() == 1:
        return coef[0].expand(*a.shape, coef.shape[-1])
    idx = torch.searchsorted(banks, a.detach().contiguous(), right=True).clamp(1, banks.numel() - 1)
    left, right = banks[idx - 1], banks[idx]
    theta = ((a - left) / (right - left)).unsqueeze(-1)
    return coef[idx - 1] * (1.0 - theta) + coef[idx] * theta


@dataclass(frozen=True)
class BankError:
    """Quantisation error of a bank layout: worst relative and absolute kernel error and where."""

    max_rel: float
    max_abs: float
    worst_alpha: float
    worst_n: int


def _interp_weights(banks: np.ndarray, alpha: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Exact bank kernels blended linearly between neighbouring banks: [len(alpha), len(n)]."""
    idx = np.clip(np.searchsorted(banks, alpha, side="right"), 1, banks.size - 1)
    theta = ((alpha - banks[idx - 1]) / (banks[idx] - banks[idx - 1]))[:, None]
    return (1.0 - theta) * gl_weights(n[None, :], banks[idx - 1][:, None]) + theta * gl_weights(
        n[None, :], banks[idx][:, None])


def _error_lags(T: int, dense: int = 4096) -> np.ndarray:
    """All n <= 2048 and a dense log-spaced sample beyond, always including T."""
    head = np.arange(1, min(T, 2048) + 1)
    tail = np.round(np.geomspace(min(T, 2048), T, dense)) if T > 2048 else np.array([])
    return np.unique(np.concatenate([head, tail, [T]])).astype(np.float64)


def bank_layout_error(banks: Sequence[float] | np.ndarray, T: int, per_interval: int = 16,
                      lags: np.ndarray | None = None) -> BankError:
    """Kernel error of quantising alpha to ``banks`` with linear interpolation (Theorem 4.1).

    Max over alpha in [banks[0], banks[-1]] (``per_interval`` evenly spaced orders inside each pair
    of neighbouring banks, end points excluded since the error vanishes there) and over lags n in
    [1, T] (default: every n <= 2048 plus 4096 log-spaced lags up to T; pass ``lags`` to use others)
    of |blend - w_n(alpha)| relative to w_n(alpha), and in absolute terms.  The exact GL weights are
    used for the banks, so this isolates the quantisation error from the SOE error.
    """
    banks = np.asarray(banks, dtype=np.float64)
    if banks.ndim != 1 or banks.size < 2 or np.any(np.diff(banks) <= 0) or banks[0] <= 0 or banks[-1] > 1:
        raise ValueError("banks must be increasing, at least two, inside (0, 1]")
    n = _error_lags(T) if lags is None else np.asarray(lags, dtype=np.float64)
    frac = np.arange(1, per_interval + 1) / (per_interval + 1)
    alphas = (banks[:-1, None] + np.diff(banks)[:, None] * frac[None, :]).ravel()
    blend = _interp_weights(banks, alphas, n)
    exact = gl_weights(n[None, :], alphas[:, None])
    abs_err = np.abs(blend - exact)
    rel_err = abs_err / exact
    i, j = np.unravel_index(np.argmax(rel_err), rel_err.shape)
    return BankError(float(rel_err[i, j]), float(abs_err.max()), float(alphas[i]), int(n[j]))


def uniform_banks(K: int, delta: float) -> np.ndarray:
    """K evenly spaced orders from delta to 1."""
    return np.linspace(delta, 1.0, K)


def equidistributed_banks(K: int, delta: float, T: int, grid: int = 2001) -> np.ndarray:
    """K orders on [delta, 1] spaced so every interval has about the same interpolation error.

    Linear interpolation of w_n(alpha) in alpha with spacing h has relative error ~ h^2/8 * M(alpha),
    M(alpha) = max_n |d^2 w_n/d alpha^2| / w_n = max_n |g'^2 + g''| with g = log w_n,
    g' = psi(n+alpha) - psi(alpha), g'' = psi'(n+alpha) - psi'(alpha).  Equal error per interval
    means spacing ~ 1/sqrt(M), i.e. banks at equal quantiles of the density sqrt(M(alpha)).
    """
    if K < 2 or not 0.0 < delta < 1.0:
        raise ValueError("need K >= 2 and 0 < delta < 1")
    alpha = torch.linspace(delta, 1.0, grid, dtype=torch.float64)[:, None]
    n = torch.from_numpy(_error_lags(T))[None, :]
    g1 = torch.digamma(n + alpha) - torch.digamma(alpha)
    g2 = torch.polygamma(1, n + alpha) - torch.polygamma(1, alpha)
    density = torch.sqrt((g1 * g1 + g2).abs().amax(dim=1)).numpy()
    a = alpha[:, 0].numpy()
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (density[1:] + density[:-1]) * np.diff(a))])
    banks = np.interp(np.linspace(0.0, cum[-1], K), cum, a)
    banks[0], banks[-1] = delta, 1.0
    return banks


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


if __name__ == "__main__":
    raise SystemExit(main())
