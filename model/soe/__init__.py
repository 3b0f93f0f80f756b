"""Certified sum-of-exponentials (SOE) form of the Grünwald–Letnikov power-law kernel (docs/soe.md).

    w_n(alpha) ~= sum_s coef_s(alpha) * lambda_s**n, with the decays lambda_s shared by every order.

``weights``: the exact reference; ``fit``: nodes and fitted coefficients; ``certificate``: choosing
S and measuring the error over every lag; ``cache``: ``build_kernel`` with checked reuse;
``banks``: interpolation between bank orders and its error; ``bounded_rates``: Proposition 4.2;
``tables``: the certified tables a VORT-family layer is built from (bank orders, tempering,
``KernelTables``); ``cli``: ``python -m model.soe``.
"""

from kernels.order import interpolate_coefficients
from model.soe.banks import BankError, bank_layout_error, equidistributed_banks, uniform_banks
from model.soe.bounded_rates import m_term_fit_error, span_fit_error
from model.soe.cache import CACHE_ENV, CACHE_VERSION, build_kernel, clear_memory_cache, default_cache_dir
from model.soe.certificate import (
    DEFAULT_ALPHA_RANGE,
    Certificate,
    SOEKernel,
    certify,
    choose_nodes,
    max_relative_error,
)
from model.soe.cli import main
from model.soe.fit import bank_coefficients, design_nodes, fit_coefficients, quadrature_coefficients
from model.soe.weights import gl_weights, soe_weights

__all__ = [
    "CACHE_ENV",
    "CACHE_VERSION",
    "DEFAULT_ALPHA_RANGE",
    "BankError",
    "Certificate",
    "SOEKernel",
    "bank_coefficients",
    "bank_layout_error",
    "build_kernel",
    "certify",
    "choose_nodes",
    "clear_memory_cache",
    "default_cache_dir",
    "design_nodes",
    "equidistributed_banks",
    "fit_coefficients",
    "gl_weights",
    "interpolate_coefficients",
    "m_term_fit_error",
    "main",
    "max_relative_error",
    "quadrature_coefficients",
    "soe_weights",
    "span_fit_error",
    "uniform_banks",
]
