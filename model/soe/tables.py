"""The certified SOE tables a VORT-family layer is built from: the bank orders, the certified kernel
for them (cached), the tempered decays, and `KernelTables`, what `VortLM.certified_kernel` returns.

They sit beside the SOE fitting and certificate they call so that model/vort.py holds only the
layer and the family; every layer of a model asks for the same tables, so the orders are cached
here and the kernels by `build_kernel`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from model.config import VortConfig
from model.soe.banks import equidistributed_banks
from model.soe.cache import build_kernel
from model.soe.certificate import SOEKernel


class KernelTables(NamedTuple):
    """A certified model's SOE kernel and the settings it was built for (`VortLM.certified_kernel`)."""

    kernel: SOEKernel
    horizon: int
    temper: int | None


SOE_TABLES = ("log_lambda", "bank_coef", "banks", "coef")  # buffer names of the certified kernel tables


def certified_kernel(banks: tuple[float, ...], horizon: int, eps: float) -> SOEKernel:
    """The certified SOE kernel for these bank orders. build_kernel caches it in the process
    and on disk ($RECURRENT_CACHE_DIR/soe, verified on read), so only the first build of a layout
    pays the seconds the certificate takes at a 512k horizon."""
    return build_kernel(np.asarray(banks, dtype=np.float64), horizon, eps, cache=True).kernel


def tempered(log_lambda: torch.Tensor, cfg: VortConfig) -> torch.Tensor:
    """The decays of the tempered kernel w_n(alpha) exp(-n / temper) (unchanged without `temper`).

    The same factor on every term multiplies the whole kernel, so the certificate's relative error
    holds for the tempered target too. Tempering bounds the kernel's mass for every order (order 1
    is otherwise a running sum that never decays): a few timescales into a long context, the
    normalised read stops drifting towards an average over the whole history (docs/vort.md).
    """
    if cfg.temper is None:
        return log_lambda
    return log_lambda - 1.0 / cfg.temper


def bank_orders(cfg: VortConfig) -> tuple[float, ...]:
    """The K bank orders on [delta, 1], spaced so each interval has about the same blend error."""
    return _bank_orders(cfg.n_banks, cfg.delta, cfg.soe_horizon)


@functools.lru_cache(maxsize=64)
def _bank_orders(n_banks: int, delta: float, horizon: int) -> tuple[float, ...]:
    # Every layer of a model asks for the same orders; computing them costs about a second at a 512k horizon.
    return tuple(float(a) for a in equidistributed_banks(n_banks, delta, horizon))
