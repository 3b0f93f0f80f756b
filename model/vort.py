"""VORT (Variable-Order Retention Transformer) and its kernel baselines pl, exp and m5.

All four are the same stack (model/blocks.py) with the same keyed linear-attention read; they differ
only in how a past token is weighted by its lag: VORT by a power law whose order a router picks per
token, the baselines by one fixed power law, one learned exponential, or five fixed ones. Every such
kernel reduces to the arguments of `kernels.soe_scan`, so all of them share one scan. docs/vort.md
gives the kernels, the design decisions and the parameter/FLOP table. The four lag kernels and the
order router are in model/vort_memory.py, the certified SOE tables they read in model/soe/tables.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.parallel import soe_scan_sequence_parallel
from model.blocks import (
    Offset,
    RMSNorm,
    StackedLM,
    SwiGLU,
    call_offset,
    next_offset,
    rotary_tables,
    short_convolution,
    token_positions,
)
from model.config import ModelConfig, VortConfig
from model.entity_labels import capitalised_word_mask
from model.interface import ScanShape, SequenceParallel
from model.soe.tables import SOE_TABLES, KernelTables, bank_orders, certified_kernel
from model.vort_memory import MEMORIES, Fp32Tables

VORT_KINDS = ("vort", "pl", "exp", "m5")
CERTIFIED_KINDS = ("vort", "pl")
"""The VORT-family kinds whose power-law kernel is a sum of exponentials certified up to soe_horizon."""


class VortState(NamedTuple):
    """What one VORT block carries between calls: the scan's per-term state, the position and, with
    `short_conv`, the convolution's last inputs."""

    G: torch.Tensor  # [B, H, S, F, D] fp32 (fp64 in a float64 run)
    b: torch.Tensor  # [B, H, S, F]
    offset: Offset  # position of the next token (within its document under doc_start: long [B])
    conv: torch.Tensor | None = None  # [B, K-1, d]; None without a short convolution


# ----------------------------------------------------------------------------- feature map


def orthogonal_gaussian(n_heads: int, n_features: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[H, F, D] projections: blocks of orthogonal rows, each row rescaled to a chi(D) norm.

    Each row is then marginally N(0, I) (so phi is unbiased) while rows in a block are orthogonal,
    which lowers the estimator's variance (Performer's ORF).
    """
    heads = []
    for _ in range(n_heads):
        rows = []
        for _ in range(math.ceil(n_features / dim)):
            q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
            rows.append((q * torch.sign(torch.diagonal(r))).T)  # sign fix: Haar-uniform, hence unbiased
        block = torch.cat(rows)[:n_features]
        norms = torch.randn(n_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
        heads.append(block * norms[:, None])
    return torch.stack(heads).float()


class PositiveRandomFeatures(Fp32Tables):
    """phi(x) = exp(W x - |x|^2 / 2) / sqrt(F), so that E[phi(q).phi(k)] = exp(q.k) and phi > 0.

    W is drawn once from `feature_seed` and the layer index. "fixed" keeps it as a buffer (saved in
    checkpoints, never redrawn); "learned" makes the same draw a trainable parameter. There is no
    periodic redraw: a carried state built with one W is meaningless under another, so a redraw
    would break streaming and exact resume.
    """

    def __init__(self, n_heads: int, head_dim: int, cfg: VortConfig, layer_index: int):
        super().__init__()
        generator = torch.Generator().manual_seed(cfg.feature_seed * 100_003 + layer_index)
        weight = orthogonal_gaussian(n_heads, cfg.n_features, head_dim, generator)
        if cfg.feature_map == "learned":
            self.weight = nn.Parameter(weight)
        else:
            self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor, scale: float | torch.Tensor, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
        """x [B, T, H, D] -> phi(s r / |r|) [B, T, H, F], r = x rotated by the rotary tables (cos, sin) if given
        (``scale`` s a number or [H, 1]): one fused kernel on the Triton backend, composite ops in the work
        dtype otherwise (kernels.positive_features)."""
        return kernels.positive_features(x, self.weight, scale, cos, sin, backend)


# ----------------------------------------------------------------------------- the layer


class VortLayer(nn.Module):
    """Keyed linear-attention retrieval through the SOE scan: x [B, T, d] -> [B, T, d].

    q and k get rotary positions, are L2-normalised and scaled to norm sqrt(temperature) (so the
    approximated score is exp(temperature * cos(q, k)) and the random features stay bounded), then
    feature-mapped. With `learn_temperature` each head learns its temperature (log-parametrised,
    capped at `temperature_max`). The kernel's per-token coefficients are folded into the scan's
    write; `readout` turns the scan's sums into the output (`readout`'s docstring).
    `backend` and `chunk_size` select the scan path (set them on the instance to switch).
    """

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        cfg = config.vort
        self.n_heads, self.head_dim, self.rope_base = config.n_heads, config.head_dim, config.rope_base
        self.rotary, self.eps = cfg.rotary, cfg.eps
        self.backend, self.chunk_size = cfg.scan_backend, cfg.chunk_size
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.fixed_temperature, self.max_log_temperature = cfg.temperature, math.log(cfg.temperature_max)
        # 1-D, so pretrain.optim leaves it out of weight decay (which would pull it towards temperature 1)
        self.log_temperature = (nn.Parameter(torch.full((config.n_heads,), math.log(cfg.temperature)))
                                if cfg.learn_temperature else None)
        if cfg.readout == "norm_gate":
            self.read_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.gate = nn.Linear(config.d_model, config.d_model, bias=False)
        else:
            self.read_norm = self.gate = None
        self.features = PositiveRandomFeatures(config.n_heads, config.head_dim, cfg, layer_index)
        self.memory = MEMORIES[config.kind](config)

    @property
    def n_features(self) -> int:
        return self.features.weight.shape[1]

    def temperature(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | float:
        """The q.k temperature: `temperature`, or with `learn_temperature` one per head [H] in
        `dtype`, capped at `temperature_max` by a clamp (as CLIP caps its logit scale: at the cap
        the gradient stops pushing it further)."""
        if self.log_temperature is None:
            return self.fixed_temperature
        return self.log_temperature.to(dtype).clamp(max=self.max_log_temperature).exp()

    def readout(self, num: torch.Tensor, den: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The scan's sums num [B, T, H, D] and den [B, T, H] -> the read [B, T, H, D], before `out`.

        "numden": num / (den + eps), the kernel- and score-weighted average of the values.
        "norm_gate": that average through a per-head RMS norm, times sigmoid(gate(x)) from the token.
        The norm of num and of num / den are the same (den is a positive scalar per token and head),
        so the average is what gets normalised: its range is the values', whereas num grows with the
        kernel's mass over a long context. The norm discards how diffuse the average is (an average
        over many unrelated values is short); the gate lets each token scale its read instead.
        """
        y = num / (den[..., None] + self.eps)
        if self.read_norm is None:
            return y
        gate = torch.sigmoid(self.gate(x).view(y.shape).to(y.dtype))
        return self.read_norm(y) * gate

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> VortState:
        shape = (batch_size, self.n_heads, self.memory.n_terms, self.n_features)
        g = torch.zeros(*shape, self.head_dim, device=device)
        return VortState(g, torch.zeros(shape, device=device), 0)

    def forward(
        self,
        x: torch.Tensor,
        state: VortState | None = None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, VortState]:
        """x [B, T, d] at positions offset.. (the carried state's, or the sequence-parallel piece's);
        with ``doc_start`` the scan's state (carried or entering from earlier pieces) is zeroed at each
        document start and positions restart. ``rotary``: the rotary tables of these positions
        (`VortLayer.rotary_tables`), made once for all layers by VortLM; made here without."""
        B, T, _ = x.shape
        sp = sequence_parallel
        offset = call_offset(None if state is None else state.offset, sp)
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        cos = sin = None  # the rotary tables: the feature map rotates q and k first
        if self.rotary:
            cos, sin = rotary if rotary is not None else self.rotary_tables(offset, T, doc_start, x.device)
        dt = kernels.work_dtype(x.dtype)
        temperature = self.temperature(dt)  # q, k [B, T, H, D] get norm sqrt(temperature)
        scale = math.sqrt(temperature) if isinstance(temperature, float) else temperature.sqrt()[:, None]
        fq, fk = (self.features(t, scale, cos, sin, self.backend) for t in (q, k))
        coef, log_lam = self.memory(x)
        # the scan's operands in the run dtype (bf16 under engine.precision=bf16); its decays, state
        # and sums stay fp32 (docs/kernels.md, "Precision")
        fq, fk, v, coef = (t.to(x.dtype) for t in (fq, fk, v, coef))
        initial = None if state is None else (state.G, state.b)
        if sp is not None:  # the state entering this piece is combined from the earlier ranks' states
            num, den, final = soe_scan_sequence_parallel(fq, fk, v, coef, log_lam, sp.group, None, True,
                                                         self.chunk_size, self.backend, reset=doc_start,
                                                         fast_terms=self.memory.fast_terms)
        else:
            num, den, final = kernels.soe_scan(fq, fk, v, coef, log_lam, initial_state=initial,
                                               output_final_state=True, chunk_size=self.chunk_size,
                                               backend=self.backend, reset=doc_start,
                                               fast_terms=self.memory.fast_terms)
        # num stays in the run's dtype: its quotient by the fp32 den is fp32 all the same, without a copy of num
        y = self.readout(num, den.to(dt), x).to(x.dtype)
        return self.out(y.reshape(B, T, -1)), VortState(final[0], final[1], next_offset(offset, T, doc_start))

    def rotary_tables(self, offset: Offset, length: int, doc_start: torch.Tensor | None,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables (cos, sin) of ``length`` tokens from ``offset`` (within their documents under
        ``doc_start``)."""
        return rotary_tables(token_positions(offset, length, doc_start, device), self.head_dim, self.rope_base)

    def extra_forward_flops(self) -> float:
        """Forward FLOPs per token not covered by 6 x parameters: fixed features and the chunked scan.

        Scan (per head, chunk c, S terms, F features, D values + 1 normaliser column): cross-chunk
        read and state write 2 x 2 S F (D+1); inside a chunk the scores 2 c F, the kernel matrix
        2 c S and the weighted values 2 c (D+1). The feature map runs on q and k, 2 x 2 F D; when W
        is learned the 6 x parameters term already counts one of the two.
        """
        F_, D, S, c = self.n_features, self.head_dim, self.memory.n_terms, self.chunk_size
        scan = 4 * S * F_ * (D + 1) + 2 * c * (F_ + S + D + 1)
        features = (1 if isinstance(self.features.weight, nn.Parameter) else 2) * 2 * F_ * D
        return float(self.n_heads * (scan + features))


class VortBlock(nn.Module):
    """Pre-norm residual block: x + layer(conv(norm(x))), then x + SwiGLU(norm(x)) (as the
    Transformer); the short convolution only with `short_conv`."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.mix_norm = RMSNorm(config.d_model, config.norm_eps)
        self.short_conv = short_convolution(config)
        self.mixer = VortLayer(config, layer_index)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.mlp_ratio)

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> VortState:
        state = self.mixer.init_state(batch_size, device)
        if self.short_conv is None:
            return state
        return state._replace(conv=self.short_conv.init_state(batch_size, device))

    def forward(
        self,
        x: torch.Tensor,
        state: VortState | None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, VortState]:
        h, conv = self.mix_norm(x), None
        if self.short_conv is not None:
            offset = call_offset(None if state is None else state.offset, sequence_parallel)
            h, conv = self.short_conv(h, None if state is None else state.conv, sequence_parallel, doc_start, offset)
        h, state = self.mixer(h, state, sequence_parallel, doc_start, rotary)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state._replace(conv=conv)


class VortLM(StackedLM):
    """A causal LM of the VORT family; `config.kind` picks the kernel (vort, pl, exp or m5)."""

    supports_sequence_parallel = True
    reports_memory = True

    @classmethod
    def sequence_parallel_problem(cls, config: ModelConfig, piece: int) -> str | None:
        if config.kind == "vort" and config.vort.entity_aux_weight > 0:
            return ("model.vort.entity_aux_weight > 0 is not supported with sequence parallelism (its word-boundary "
                    "labels look across the piece border); set it to 0 or use sequence_parallel: 1")
        return None

    def block_inputs(self, embedded: torch.Tensor, first_state: VortState | None,
                     sequence_parallel: SequenceParallel | None, doc_start: torch.Tensor | None) -> dict[str, Any]:
        """The rotary tables of the call's positions, made once for every layer (and not again in their
        recompute under activation checkpointing): each layer's would be the same, as all carry one offset."""
        if not self.config.vort.rotary:
            return {}
        offset = call_offset(None if first_state is None else first_state.offset, sequence_parallel)
        layer = self.blocks[0].mixer
        return {"rotary": layer.rotary_tables(offset, embedded.shape[1], doc_start, embedded.device)}

    @classmethod
    def scan_shape(cls, config: ModelConfig) -> ScanShape:
        """The SOE scan's sizes; the number of terms is the kernel's, so building it may certify one."""
        v = config.vort
        n_terms = MEMORIES[config.kind](config).n_terms
        return ScanShape("soe", (config.n_heads, n_terms, v.n_features, config.head_dim, v.chunk_size))

    @property
    def certified_horizon(self) -> int | None:
        return self.config.vort.soe_horizon if self.config.kind in CERTIFIED_KINDS else None

    def certified_kernel(self) -> KernelTables | None:
        if self.certified_horizon is None:
            return None
        cfg = self.config.vort
        banks = bank_orders(cfg) if self.config.kind == "vort" else (cfg.pl_alpha,)
        return KernelTables(certified_kernel(banks, cfg.soe_horizon, cfg.soe_eps), cfg.soe_horizon, cfg.temper)

    def with_kernel(self, **settings: Any) -> VortLM:
        """The same weights with the SOE tables rebuilt from other `model.vort` kernel settings
        (`soe_horizon`, `temper`). The tables (decays, bank coefficients, bank orders) are fixed buffers
        derived from the settings, not learned, so a certified model can be scored with a kernel
        certified further than in training, or tempered; the router's continuous order is mapped
        onto the new banks."""
        if self.certified_horizon is None:
            return super().with_kernel(**settings)
        config = dataclasses.replace(self.config, vort=dataclasses.replace(self.config.vort, **settings))
        rebuilt = VortLM(config)
        tables = {name for name, _ in rebuilt.named_buffers() if name.rsplit(".", 1)[-1] in SOE_TABLES}
        weights = {k: v for k, v in self.state_dict().items() if k not in tables}
        missing, unexpected = rebuilt.load_state_dict(weights, strict=False)
        if set(missing) != tables or unexpected:
            raise ValueError(f"rebuilding the kernel: unexpected state keys (missing {missing}, "
                             f"unexpected {unexpected})")
        return rebuilt.to(next(self.parameters()).device).eval()

    def memory_report(self, state: list[VortState], train_len: int) -> list[dict[str, float]]:
        """Per layer: the normaliser's mass (summed over terms and features, mean over heads); for fixed
        decays, the share of it in terms slower than `train_len` and in the slowest term; and the
        router's mean order and top-bank share where it routes."""
        report = []
        for block, layer_state in zip(self.blocks, state, strict=True):
            mass = layer_state.b[0].double().sum(-1).mean(0)  # [S]
            total = float(mass.sum())
            entry: dict[str, float] = {"normaliser_mass": total}
            memory = block.mixer.memory
            log_lam = getattr(memory, "log_lambda", None)  # exp learns its decay: no fixed terms
            if log_lam is not None and total > 0:
                log_lam = log_lam.double()
                entry["long_term_share"] = float(mass[log_lam > -1.0 / train_len].sum()) / total
                entry["order_one_share"] = float(mass[log_lam.argmax()]) / total  # the slowest term
            stats = memory.stats()
            if "alpha_mean" in stats:
                entry["alpha_mean"] = float(stats["alpha_mean"])
                entry["top_bank_share"] = float(stats["bank_share"][-1])
            report.append(entry)
        return report

    def state_bytes(self, batch: int, sequence_parallel: int) -> tuple[float, float]:
        """fp32 numerator and normaliser sums per term and feature; under sequence parallelism the N
        gathered states plus the entering and corrected final ones per layer."""
        c, mixer = self.config, self.blocks[0].mixer
        per_layer = batch * c.n_heads * mixer.memory.n_terms * mixer.n_features * (c.head_dim + 1) * 4
        buffers = c.n_layers * per_layer * (sequence_parallel + 2) if sequence_parallel > 1 else 0.0
        return c.n_layers * per_layer, buffers

    def scan_buffer_bytes(self, batch: int, tokens: int) -> float:
        """The Triton SOE scan's buffers, counted on the meta device (kernels/soe/gpu/footprint.py): what every
        layer's forward keeps for its backward (the span states, and the per-chunk states where one phase
        covers the sequence; where several do, the forward frees those, and counting them is an overcount),
        plus one layer's call at once, its outputs and input gradients included."""
        from kernels.soe.gpu.footprint import scan_allocations

        c, mixer = self.config, self.blocks[0].mixer
        sizes = (c.n_heads, mixer.memory.n_terms, mixer.n_features, c.head_dim, mixer.chunk_size)
        counts = scan_allocations(sizes, tokens, batch)
        outputs = batch * tokens * c.n_heads * (c.head_dim + 1) * 2  # o and z in bf16: activations already
        return (counts["forward"] - outputs) * (c.n_layers - 1) + counts["forward"] + counts["backward"]

    def __init__(self, config: ModelConfig):
        if config.kind not in VORT_KINDS:
            raise ValueError(f"kind: VortLM builds {', '.join(VORT_KINDS)}, got {config.kind!r}")
        super().__init__(config, lambda i: VortBlock(config, i))

    def loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any = None, doc_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        """The LM loss; in training with `vort.entity_aux_weight > 0`, plus that weight times the mean
        (over layers) binary cross-entropy of the entity probe against capitalised_word_mask."""
        loss, state = super().loss(input_ids, labels, state, doc_start)
        weight = self.config.vort.entity_aux_weight
        if self.training and weight > 0 and self.config.kind == "vort":
            target = capitalised_word_mask(input_ids)
            scores = [block.mixer.memory.entity_score for block in self.blocks]
            aux = torch.stack([F.binary_cross_entropy(p.float().clamp(1e-6, 1 - 1e-6), target) for p in scores])
            loss = loss + weight * aux.mean()
        return loss, state

    def flops_per_token(self, seq_len: int) -> float:
        """6 per matmul parameter plus 3 x the non-parameter forward work; linear cost, so no seq_len term."""
        extra = sum(block.mixer.extra_forward_flops() for block in self.blocks)
        return 6.0 * self.matmul_params() + 3.0 * extra

    def stats(self) -> dict[str, Any]:
        """`<kind>/layer<i>/<name>` for each layer's kernel statistics from the last forward pass."""
        out: dict[str, Any] = {}
        for i, block in enumerate(self.blocks):
            for name, value in block.mixer.memory.stats().items():
                out[f"{self.config.kind}/layer{i}/{name}"] = value
        return out
