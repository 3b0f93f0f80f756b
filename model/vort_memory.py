"""The lag kernels of the VORT family, one module per `model.kind`, and the order router VORT's uses.

Each memory maps the layer input to the arguments of `kernels.soe_scan`: per-token coefficients
[B, T, H, S] and per-head log-decays [H, S]. vort and pl read certified SOE tables
(model/soe/tables.py), exp learns one decay per head, m5 mixes five fixed decays. They live apart
from model/vort.py (the layer and the family) as PMNet's memory lives in model/pmnet_memory.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.order import orders
from model.config import ModelConfig, VortConfig
from model.soe.tables import bank_orders, certified_kernel, tempered


class Fp32Tables(nn.Module):
    """Base of modules whose own buffers are fixed tables (SOE decays and coefficients, features).

    Casting the model (`.bfloat16()`, DeepSpeed's bf16 mode) moves these buffers to the new device
    but keeps them fp32: rounded to bf16's 8 mantissa bits the SOE coefficients would no longer meet
    their certificate, and a checkpoint's features would differ from the ones trained with.
    """

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        tables = {n: b for n, b in self._buffers.items() if b is not None and b.is_floating_point()}
        super()._apply(fn, recurse)
        for name, table in tables.items():
            self._buffers[name] = table.to(device=self._buffers[name].device)
        return self



def track_fast_terms(memory: nn.Module) -> None:
    """Set ``memory.fast_terms``, the leading terms of its fixed decays ``log_lambda`` that decay below 2^-30
    within kernels.soe.FAST_REACH tokens (what kernels.soe_scan takes as ``fast_terms``), now and again
    whenever a state dict is loaded into it (a checkpoint's decays are the ones it trained with)."""

    def count(module: nn.Module, _keys: Any = None) -> None:
        module.fast_terms = kernels.fast_term_count(module.log_lambda)

    count(memory)
    memory.register_load_state_dict_post_hook(count)


class OrderRouter(nn.Module):
    """alpha_t in [delta, 1] per head from two shallow probes of the layer input.

    - predictive probe: a rank-r softmax head over P classes; its entropy, normalised by log P to
      [0, 1], is the token's contextual uncertainty;
    - entity probe: a linear classifier, sigmoid score in (0, 1).
    alpha = delta + (1 - delta) sigmoid(bias_h + a_h (1 - entropy) + c_h (2 entity - 1)). The gains
    start positive (confident or entity tokens get a high order, uncertain non-entities a low one,
    as the paper intends) and the biases spread the heads over the range; all are learned.
    The probes are plain parameters with their own 1/sqrt(fan-in) init, so they start informative
    (the stack's small nn.Linear init would start the entropy at its flat maximum, where its
    gradient vanishes).
    """

    def __init__(self, d_model: int, n_heads: int, cfg: VortConfig):
        super().__init__()
        self.delta = cfg.delta
        self.probe_down = nn.Parameter(torch.randn(d_model, cfg.probe_rank) / math.sqrt(d_model))
        self.probe_up = nn.Parameter(torch.randn(cfg.probe_rank, cfg.probe_classes) / math.sqrt(cfg.probe_rank))
        self.entity_weight = nn.Parameter(torch.randn(d_model) / math.sqrt(d_model))
        self.entity_bias = nn.Parameter(torch.zeros(1))  # 1-D: DeepSpeed cannot broadcast 0-dim parameters
        self.entropy_gain = nn.Parameter(torch.full((n_heads,), 2.0))
        self.entity_gain = nn.Parameter(torch.full((n_heads,), 2.0))
        self.bias = nn.Parameter(torch.linspace(-2.0, 2.0, n_heads) if n_heads > 1 else torch.zeros(1))

    def probes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> the predictive probe's logits [B, T, P] (in x's dtype) and the entity score [B, T]
        (in the work dtype)."""
        # the probes' products take x in the run's dtype (bf16 on the tensor cores, fp32 accumulation); the
        # softmax, entropy and gates that follow run in fp32
        dt = kernels.work_dtype(x.dtype)
        logits = x @ self.probe_down.to(x.dtype) @ self.probe_up.to(x.dtype)
        entity = torch.sigmoid((x @ self.entity_weight.to(x.dtype)).to(dt) + self.entity_bias.to(dt))
        return logits, entity

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> (alpha [B, T, H], entropy [B, T] in [0, 1], entity score [B, T]), composite (the
        memory makes alpha and its coefficients in one op, kernels.order_coefficients)."""
        logits, entity = self.probes(x)
        alpha, entropy = orders(logits, entity, self.bias, self.entropy_gain, self.entity_gain, self.delta)
        return alpha, entropy, entity


class VariableOrderMemory(Fp32Tables):
    """The vort kernel: routed orders, K banks of SOE coefficients, interpolation between banks."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = config.vort
        self.n_heads, self.n_bins = config.n_heads, cfg.alpha_bins
        log_lambda, coef, banks = certified_kernel(bank_orders(cfg), cfg.soe_horizon, cfg.soe_eps).as_tensors()
        self.register_buffer("log_lambda", tempered(log_lambda, cfg))
        track_fast_terms(self)
        self.register_buffer("bank_coef", coef)
        self.register_buffer("banks", banks)
        self.router = OrderRouter(config.d_model, config.n_heads, cfg)
        self.backend = "auto"  # kernels.order_coefficients': one fused Triton op for CUDA tensors, composite on CPU
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.entity_score: torch.Tensor | None = None  # with its graph, for the auxiliary loss

    @property
    def n_terms(self) -> int:
        return self.log_lambda.numel()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> (coef [B, T, H, S], log_lam [H, S])."""
        logits, entity = self.router.probes(x)
        r = self.router
        coef, alpha, _entropy = kernels.order_coefficients(logits, entity, r.bias, r.entropy_gain, r.entity_gain,
                                                           self.banks, self.bank_coef, r.delta, self.backend)
        self._last = (alpha.detach(), entity.detach())
        self.entity_score = entity
        return coef, self.log_lambda.to(alpha.dtype).expand(self.n_heads, -1)

    @property
    def last_routing(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(alpha [B, T, H], entity score [B, T]) of the last forward pass, detached; None before it."""
        return self._last

    def stats(self) -> dict[str, Any]:
        """Alpha histogram (counts over `alpha_bins` equal bins of [0, 1]), share per bank, probe means."""
        if self._last is None:
            return {}
        alpha, entity = (t.float() for t in self._last)
        nearest = (alpha[..., None] - self.banks.float()).abs().argmin(-1)
        share = torch.bincount(nearest.flatten(), minlength=self.banks.numel()).float() / nearest.numel()
        return {
            "alpha_hist": torch.histc(alpha, bins=self.n_bins, min=0.0, max=1.0),
            "alpha_mean": alpha.mean().item(),
            "bank_share": share,
            "entity_score": entity.mean().item(),
        }


class FixedOrderMemory(Fp32Tables):
    """The pl kernel: the SOE power law of one fixed order for every token."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = config.vort
        self.n_heads = config.n_heads
        log_lambda, coef, _ = certified_kernel((cfg.pl_alpha,), cfg.soe_horizon, cfg.soe_eps).as_tensors()
        self.register_buffer("log_lambda", tempered(log_lambda, cfg))
        track_fast_terms(self)
        self.register_buffer("coef", coef[0].clone())

    @property
    def n_terms(self) -> int:
        return self.log_lambda.numel()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = kernels.work_dtype(x.dtype)
        coef = self.coef.to(dt).expand(*x.shape[:2], self.n_heads, -1)
        return coef, self.log_lambda.to(dt).expand(self.n_heads, -1)

    def stats(self) -> dict[str, Any]:
        return {}


class ExpMemory(nn.Module):
    """The exp kernel: one exponential per head, lambda_h = exp(-1 / tau_h) with tau_h learned.

    Timescales start geometrically spread from 4 tokens to max_seq_len across heads.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        timescales = np.geomspace(4.0, max(8.0, float(config.max_seq_len)), config.n_heads)
        self.log_timescale = nn.Parameter(torch.tensor(np.log(timescales), dtype=torch.float32))

    n_terms = 1
    fast_terms = 0  # its decay is learned: nothing is known of it on the host

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = kernels.work_dtype(x.dtype)
        log_lam = -torch.exp(-self.log_timescale.to(dt))[:, None]
        return x.new_ones(*x.shape[:2], self.n_heads, 1, dtype=dt), log_lam

    def stats(self) -> dict[str, Any]:
        return {"timescale": self.log_timescale.detach().float().exp()}


class MixtureMemory(Fp32Tables):
    """The m5 kernel: five fixed decays exp(-1 / tau_s) with learned positive weights per head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        timescales = torch.tensor(config.vort.m5_timescales, dtype=torch.float64)
        self.register_buffer("log_lambda", (-1.0 / timescales).float())
        track_fast_terms(self)
        self.raw_weight = nn.Parameter(torch.full((config.n_heads, timescales.numel()), math.log(math.e - 1.0)))

    @property
    def n_terms(self) -> int:
        return self.log_lambda.numel()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = kernels.work_dtype(x.dtype)
        coef = F.softplus(self.raw_weight.to(dt)).expand(*x.shape[:2], -1, -1)
        return coef, self.log_lambda.to(dt).expand(self.n_heads, -1)

    def stats(self) -> dict[str, Any]:
        return {"weights": F.softplus(self.raw_weight.detach().float()).mean(0)}


MEMORIES: dict[str, type[nn.Module]] = {
    "vort": VariableOrderMemory,
    "pl": FixedOrderMemory,
    "exp": ExpMemory,
    "m5": MixtureMemory,
}
