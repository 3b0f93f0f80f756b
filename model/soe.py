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
  maximum relative error over *every* n in [0, T] against the reference (``max_relative_error``:
  one float64 matmul per chunk of lags and an exact running-product reference, about 1 s for 40
  orders at T = 524288).  ``build_kernel(..., cache=True)`` reuses certificates from this process
  and from checksummed JSON files under ``default_cache_dir()`` (re-checked before use).
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
import contextlib
import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
# Fitting sample: every n <= _FIT_HEAD plus _FIT_DENSE log-spaced lags up to T.
_FIT_HEAD = 63
_FIT_DENSE = 400
# Largest S ``certify`` tries by default.
_MAX_TERMS = 96
# Bump whenever a change to the construction could change the kernel produced for the same inputs
# (node family, fitting sample, Lawson rule, certify's search): cached kernels of another version
# are then ignored instead of being served under the new code.
CACHE_VERSION = 1
# Environment variable naming the project's cache root (kernels go to its ``soe`` subfolder).
CACHE_ENV = "RECURRENT_CACHE_DIR"


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


def max_relative_error(log_lambda: np.ndarray, coef: np.ndarray, alphas: Sequence[float] | np.ndarray,
                       T: int) -> np.ndarray:
    """Max over every integer n in [0, T] of |soe - w_n(alpha)| / w_n(alpha), one value per order.

    ``coef`` is [K, S] aligned with ``alphas``.  All T + 1 lags are evaluated (in chunks of
    ``_CHUNK``), so this is a measurement, not an estimate from a sample.

    Speed: the SOE side is one float64 matmul per chunk against a [S, chunk] table of powers that is
    computed once per call and shared by every order (the chunk offset is folded into the
    coefficients).  The reference side is the exact recurrence w_n = w_{n-1} (n - 1 + alpha) / n run
    as a cumulative product along n, carried from chunk to chunk from w_0 = 1, instead of three
    lgammas per (n, alpha).  Each step rounds three times (add, divide, multiply), so the reference
    is within 3 (T + 1) u of the true weight (u = 2^-53: 1.7e-10 relative at T = 524288), tighter
    than the lgamma difference used by ``gl_weights`` (~1e-9 there) and nowhere near any eps used.
    """
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    coef = np.atleast_2d(np.asarray(coef, dtype=np.float64))
    log_lambda = np.asarray(log_lambda, dtype=np.float64)
    if coef.shape != (alphas.size, log_lambda.size):
        raise ValueError(f"coef must be [{alphas.size}, {log_lambda.size}], got {list(coef.shape)}")
    if np.any(alphas <= 0.0):
        raise ValueError("orders must be > 0 (relative error against w_n(0) = 0 for n > 0 is undefined)")
    worst = np.zeros(alphas.size)
    if alphas.size == 0:
        return worst
    width = min(_CHUNK, T + 1)
    # lambda**(start + j) = lambda**j * lambda**start, all factors <= 1 (no division, no overflow).
    table = np.exp(log_lambda[:, None] * np.arange(width, dtype=np.float64)[None, :])
    exact = np.empty((alphas.size, width))
    approx = np.empty((alphas.size, width))
    last = np.ones(alphas.size)  # w_{start - 1}, carried across chunks
    for start in range(0, T + 1, width):
        count = min(T + 1, start + width) - start
        n = np.arange(start, start + count, dtype=np.float64)
        ex, ap = exact[:, :count], approx[:, :count]
        # Ratios w_n / w_{n-1} = (n - 1 + alpha) / n, then a running product.
        np.add((n - 1.0)[None, :], alphas[:, None], out=ex)
        if start == 0:
            ex[:, 0] = 1.0  # w_0 = 1 exactly
            np.divide(ex[:, 1:], n[None, 1:], out=ex[:, 1:])
        else:
            np.divide(ex, n[None, :], out=ex)
            ex[:, 0] *= last
        np.cumprod(ex, axis=1, out=ex)
        last = ex[:, -1].copy()
        np.matmul(coef * np.exp(start * log_lambda), table[:, :count], out=ap)
        np.subtract(ap, ex, out=ap)
        np.abs(ap, out=ap)
        np.divide(ap, ex, out=ap)
        np.maximum(worst, ap.max(axis=1), out=worst)
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
    """Max relative error of the fitted kernel on the fitting sample (cheap screen before certifying).

    Memoised per (nodes, alpha, T) like the fit: the bisection, the placement scan and certify's
    retry ask about the same node sets repeatedly.
    """
    return _sample_error_cached(np.asarray(log_lambda, dtype=np.float64).tobytes(), float(alpha), int(T))


@functools.lru_cache(maxsize=4096)
def _sample_error_cached(nodes_bytes: bytes, alpha: float, T: int) -> float:
    log_lambda = np.frombuffer(nodes_bytes, dtype=np.float64)
    n = _fit_sample(T)
    c = fit_coefficients(log_lambda, alpha, T)
    return float(np.max(np.abs(soe_weights(log_lambda, c, n) / gl_weights(n, alpha) - 1.0)))


def choose_nodes(T: int, eps: float, alpha_range: tuple[float, float] = DEFAULT_ALPHA_RANGE,
                 max_terms: int = _MAX_TERMS) -> np.ndarray:
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
            alpha_range: tuple[float, float] = DEFAULT_ALPHA_RANGE, max_terms: int = _MAX_TERMS) -> Certificate:
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
        if requested is None:
            banks, coef = design, design_coef
            rel = design_rel = max_relative_error(nodes, design_coef, design, T)
        else:
            # One pass over every lag for the design and the requested orders together: the table
            # of powers is built once and the per-chunk work is one matmul for all of them.
            banks, coef = requested, bank_coefficients(requested, nodes, T)
            both = max_relative_error(nodes, np.concatenate([design_coef, coef]),
                                      np.concatenate([design, banks]), T)
            design_rel, rel = both[: design.size], both[design.size:]
        design_err = float(design_rel.max(initial=0.0))
        if max(design_err, float(rel.max(initial=0.0))) <= eps:
            return Certificate(SOEKernel(nodes, coef, banks), T, eps, (lo, hi), rel, design_err)
        if nodes.size >= max_terms:
            raise ValueError(f"no SOE kernel with <= {max_terms} terms meets eps={eps} for T={T}")
        # The sample screen passed but a lag between samples did not: one more decaying node
        # (nodes.size counts the lambda = 1 node, so this is the current decaying count + 1).
        nodes = min((design_nodes(T, nodes.size, a, b) for a in _NODE_LO for b in _NODE_HI),
                    key=lambda nd: max(_sample_error(nd, a, T) for a in design))


def build_kernel(banks: Sequence[float] | np.ndarray, T: int, eps: float = 1e-3, *, cache: bool = False,
                 cache_dir: str | os.PathLike[str] | None = None) -> Certificate:
    """Certified SOE kernel for the given bank orders (the layer's constructor entry point).

    With ``cache=True`` a certificate already built for the same (banks, T, eps, node family,
    ``CACHE_VERSION``) is reused: first from this process (a copy, so callers cannot alter the
    stored one), then from a JSON file in ``cache_dir`` (default ``default_cache_dir()``).  A file
    is only used after ``_load_entry`` has checked its checksum, its shapes and its inputs, and has
    re-measured the kernel on the fitting sample; anything unreadable or inconsistent is ignored and
    the kernel is rebuilt (and the file rewritten).  A fresh certificate is always measured over
    every n in [0, T].  Without ``cache`` nothing is read or written (pure computation).
    """
    banks = np.asarray(banks, dtype=np.float64)
    if banks.ndim != 1 or banks.size == 0 or np.any(np.diff(banks) <= 0):
        raise ValueError("banks must be a non-empty increasing 1-D sequence")
    if not cache:
        return _certify_banks(banks, T, eps)
    key = _cache_key(banks, T, eps)
    held = _MEMORY_CACHE.get(key)
    if held is not None and np.array_equal(held.kernel.banks, banks):
        return _copy_certificate(held)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"{key}.json"
    cert = _load_entry(path, key, banks, T, eps)
    if cert is None:
        cert = _certify_banks(banks, T, eps)
        _store_entry(path, key, cert)
    _MEMORY_CACHE[key] = _copy_certificate(cert)
    return cert


def _certify_banks(banks: np.ndarray, T: int, eps: float) -> Certificate:
    """``certify`` on the range spanned by the banks below 1 (just alpha = 1 when there are none)."""
    below_one = banks[banks < 1.0]
    rng = (float(below_one.min()), float(below_one.max())) if below_one.size else (1.0, 1.0)
    return certify(T, eps, banks, alpha_range=rng)


# --- cache of certified kernels -------------------------------------------------------------------

_MEMORY_CACHE: dict[str, Certificate] = {}
# A cached entry re-measured on the fitting sample must reproduce its stored sample error this closely
# (relative), which it does to rounding when the file is what this code wrote.
_VERIFY_RTOL = 1e-6


def default_cache_dir() -> Path:
    """``$RECURRENT_CACHE_DIR/soe`` when the variable is set, else ``~/.cache/recurrent-pretrain/soe``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) / "soe" if root else Path.home() / ".cache" / "recurrent-pretrain" / "soe"


def clear_memory_cache() -> None:
    """Forget the certificates held by this process (the files on disk stay)."""
    _MEMORY_CACHE.clear()


def _family() -> dict[str, object]:
    """Everything besides the inputs that decides which kernel ``certify`` builds (part of the key)."""
    return {
        "node_lo": list(_NODE_LO), "node_hi": list(_NODE_HI), "design_points": _DESIGN_POINTS,
        "lawson_iters": _LAWSON_ITERS, "lawson_patience": _LAWSON_PATIENCE, "fit_head": _FIT_HEAD,
        "fit_dense": _FIT_DENSE, "max_terms": _MAX_TERMS,
    }


def _cache_key(banks: np.ndarray, T: int, eps: float) -> str:
    """sha256 of the inputs: banks rounded to 12 decimals (the stored banks must still match exactly)."""
    spec = {"version": CACHE_VERSION, "banks": [round(float(b), 12) for b in banks], "T": int(T),
            "eps": float(eps), "family": _family()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]


def _checksum(payload: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _copy_certificate(cert: Certificate) -> Certificate:
    k = cert.kernel
    return Certificate(SOEKernel(k.log_lambda.copy(), k.coef.copy(), k.banks.copy()), cert.T, cert.eps,
                       cert.alpha_range, cert.rel_err.copy(), cert.design_err)


def _sample_errors(log_lambda: np.ndarray, coef: np.ndarray, alphas: np.ndarray, T: int) -> np.ndarray:
    """Max relative error per order on the fitting sample (the cache's cheap re-measurement)."""
    n = _fit_sample(T)
    exact = gl_weights(n[None, :], alphas[:, None])
    return np.max(np.abs(soe_weights(log_lambda, coef, n) / exact - 1.0), axis=1)


def _store_entry(path: Path, key: str, cert: Certificate) -> None:
    """Write the certificate as JSON, atomically (temp file in the same folder, then os.replace).

    A failure to write (read-only home, full disk) only costs the next process a rebuild: warn.
    """
    k = cert.kernel
    payload = {
        "version": CACHE_VERSION, "key": key, "T": int(cert.T), "eps": float(cert.eps),
        "banks": k.banks.tolist(), "alpha_range": list(cert.alpha_range), "log_lambda": k.log_lambda.tolist(),
        "coef": k.coef.tolist(), "rel_err": cert.rel_err.tolist(), "design_err": float(cert.design_err),
        "sample_err": _sample_errors(k.log_lambda, k.coef, k.banks, cert.T).tolist(),
    }
    text = json.dumps({"payload": payload, "sha256": _checksum(payload)})
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache folder should stay readable
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        warnings.warn(f"SOE kernel cache: could not write {path}: {exc}", stacklevel=3)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _load_entry(path: Path, key: str, banks: np.ndarray, T: int, eps: float) -> Certificate | None:
    """The cached certificate at ``path``, or None when it is missing or fails any check.

    Checks, in order: the file parses as JSON; the sha256 of its payload matches (a truncated or
    edited file fails here); version, key, T, eps and the banks (exactly, as float64) are the ones
    asked for; the arrays have the certificate's shapes and invariants (finite, log_lambda ascending
    <= 0 ending in 0, rows summing to 1) and the recorded errors meet eps; and the kernel re-measured
    on the fitting sample reproduces the recorded sample errors.  The full measurement over every n
    was done when the entry was written (``max_relative_error`` can repeat it at any time).
    """
    try:
        doc = json.loads(path.read_text())
        payload = doc["payload"]
        if doc["sha256"] != _checksum(payload):
            return None
        if (payload["version"] != CACHE_VERSION or payload["key"] != key or payload["T"] != int(T)
                or payload["eps"] != float(eps)):
            return None
        stored_banks = np.asarray(payload["banks"], dtype=np.float64)
        if stored_banks.shape != banks.shape or not np.array_equal(stored_banks, banks):
            return None
        log_lambda = np.asarray(payload["log_lambda"], dtype=np.float64)
        coef = np.asarray(payload["coef"], dtype=np.float64)
        rel_err = np.asarray(payload["rel_err"], dtype=np.float64)
        sample_err = np.asarray(payload["sample_err"], dtype=np.float64)
        design_err = float(payload["design_err"])
        lo, hi = (float(x) for x in payload["alpha_range"])
        S = log_lambda.size
        if (log_lambda.ndim != 1 or S == 0 or coef.shape != (banks.size, S) or rel_err.shape != banks.shape
                or sample_err.shape != banks.shape):
            return None
        arrays = (log_lambda, coef, rel_err, sample_err)
        if not all(np.all(np.isfinite(x)) for x in arrays) or not math.isfinite(design_err):
            return None
        if log_lambda[-1] != 0.0 or np.any(np.diff(log_lambda) <= 0.0):
            return None
        if not np.allclose(coef.sum(axis=1), 1.0, rtol=0.0, atol=1e-9):
            return None
        if rel_err.max() > eps or design_err > eps:
            return None
        again = _sample_errors(log_lambda, coef, banks, T)
        # The sample is a subset of [0, T]: its errors cannot exceed the recorded all-lag maxima
        # (up to the two references' ~1e-9 disagreement at the longest lags).
        if (not np.allclose(again, sample_err, rtol=_VERIFY_RTOL, atol=1e-15)
                or np.any(again > rel_err + 1e-8)):
            return None
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return Certificate(SOEKernel(log_lambda, coef, banks.copy()), int(T), float(eps), (lo, hi), rel_err, design_err)


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
