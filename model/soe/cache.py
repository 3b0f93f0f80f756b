"""``build_kernel``: the layer's entry point, reusing checked certificates from this process and from disk."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from model.soe.certificate import _DESIGN_POINTS, _MAX_TERMS, Certificate, SOEKernel, certify
from model.soe.fit import (
    _FIT_DENSE,
    _FIT_HEAD,
    _LAWSON_ITERS,
    _LAWSON_PATIENCE,
    _NODE_HI,
    _NODE_LO,
    _fit_sample,
)
from model.soe.weights import gl_weights, soe_weights

# Bump whenever a change to the construction could change the kernel produced for the same inputs
# (node family, fitting sample, Lawson rule, certify's search): cached kernels of another version
# are then ignored instead of being served under the new code.
CACHE_VERSION = 1
# Environment variable naming the project's cache root (kernels go to its ``soe`` subfolder).
CACHE_ENV = "RECURRENT_CACHE_DIR"


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


_MEMORY_CACHE: dict[str, Certificate] = {}
# A cached entry re-measured on the fitting sample must reproduce its stored sample error this closely
# (relative), which it does to rounding when the file is what this code wrote.
_VERIFY_RTOL = 1e-6


def default_cache_dir() -> Path:
    """``$RECURRENT_CACHE_DIR/soe`` when the variable is set, else ``~/.cache/recurrent-pretrain/soe``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) / "soe" if root else Path.home() / ".cache" / "recurrent-pretrain" / "soe"


def clear_memory_cache() -> None:
    """Forget the certificates held by this process (the files on disk stay); the in-process cache
    grows with every (banks, T, eps) asked for, so whoever holds it needs a way to release it."""
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
