"""Model hyper-parameters: the fields every family shares, plus one section per family."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal, get_args

from model.config_loader import ConfigError, build_config, check_range, read_tree

ModelKind = Literal["transformer", "vort", "pl", "exp", "m5", "pmnet"]


@dataclasses.dataclass
class VortConfig:
    """The VORT family (kinds vort, pl, exp, m5): feature map, router, SOE banks, scan.

    docs/vort.md explains each choice. The kernel baselines use only the fields that concern
    them (pl: `pl_alpha`; exp: nothing kernel-specific; m5: `m5_timescales`). `temper` (tokens)
    tempers the vort and pl kernels: w_n(alpha) exp(-n / temper). `entity_aux_weight` (vort only)
    adds the weak-label entity loss of model/entity_labels.py to training.

    The q.k score is exp(temperature * cos(q, k)); `learn_temperature` makes it one learned
    temperature per head and layer (log-parametrised, starting at `temperature`), capped at
    `temperature_max`, which bounds the random features' exponent for every head (docs/vort.md).
    `readout` is how the layer turns the scan's sums into its output: "numden" the normalised
    average num / den, "norm_gate" that average through a per-head RMS norm and a sigmoid gate
    computed from the token (GLA/RetNet style), every kind alike.
    """

    n_features: int = 64
    feature_map: Literal["fixed", "learned"] = "fixed"
    feature_seed: int = 0
    temperature: float = 2.0
    learn_temperature: bool = False
    temperature_max: float = 8.0
    readout: Literal["numden", "norm_gate"] = "numden"
    rotary: bool = True
    delta: float = 0.1
    n_banks: int = 8
    soe_horizon: int = 524288
    soe_eps: float = 1e-3
    temper: int | None = None
    pl_alpha: float = 0.5
    m5_timescales: list[float] = dataclasses.field(default_factory=lambda: [4.0, 32.0, 256.0, 2048.0, 16384.0])
    probe_rank: int = 32
    probe_classes: int = 256
    alpha_bins: int = 20
    entity_aux_weight: float = 0.0
    eps: float = 1e-6
    chunk_size: int = 64
    scan_backend: Literal["auto", "reference", "torch", "triton"] = "auto"

    def __post_init__(self) -> None:
        for key in ("n_features", "n_banks", "soe_horizon", "probe_rank", "probe_classes", "alpha_bins", "chunk_size"):
            check_range(key, getattr(self, key), low=1)
        check_range("n_banks", self.n_banks, low=2, note=" (interpolation needs two banks)")
        check_range("delta", self.delta, low=0, high=1, low_open=True, high_open=True)
        if not self.delta <= self.pl_alpha <= 1:
            raise ValueError(f"pl_alpha: must be in [delta={self.delta}, 1], got {self.pl_alpha}")
        check_range("temperature", self.temperature, low=0, low_open=True)
        if self.temperature > self.temperature_max:
            raise ValueError(f"temperature: must be <= temperature_max={self.temperature_max} (the bound that keeps "
                             f"the random features finite in fp32), got {self.temperature}")
        if self.readout not in ("numden", "norm_gate"):
            raise ValueError(f"readout: must be 'numden' or 'norm_gate', got {self.readout!r}")
        if self.temper is not None and self.temper < 1:
            raise ValueError(f"temper: must be a number of tokens >= 1 or null (no tempering), got {self.temper}")
        check_range("soe_eps", self.soe_eps, low=0, high=1, low_open=True, high_open=True)
        check_range("eps", self.eps, low=0, low_open=True)
        check_range("entity_aux_weight", self.entity_aux_weight, low=0, note=" (0 disables it)")
        if len(self.m5_timescales) != 5 or min(self.m5_timescales) <= 0:
            raise ValueError(f"m5_timescales: must be 5 positive numbers of tokens, got {self.m5_timescales}")


@dataclasses.dataclass
class PMNetConfig:
    """The PMNet family: sliding-window attention plus a hierarchical unit-phasor memory.

    docs/pmnet.md explains each choice. `memory_every = 0` gives the SWA-only ablation; the two
    `update_memory_*` switches freeze the memory (reads still happen) for the paper's ablation;
    `collision_scope` is where the writers s of the 1/sqrt(s) gradient normalisation are counted
    ("none": no normalisation, for the ablation); `segment_len` is the unit of the "segment" scope
    and of the collision statistic (routing does not depend on it). `memory_horizon` H > 0 sends
    every slot back to its initial phase at each position of a document that is a multiple of H, so
    the phases at any position are sums of at most H writes, as in training at H tokens (0: never).

    Routing (docs/pmnet.md, "Routing options"): `routing` "learned" compares the learned query with
    learned anchors, "router" a learned projection of its own (the query phases then only
    demodulate the read), "hash" a fixed random projection with fixed anchors (nothing of it
    learns, so it cannot collapse). `write_address` "current" writes each token on its own read path,
    "previous" on the read path of the token before it (a pair [key][value] then writes the value
    where the key's query reads), "conv" on a route of its own, from a learned projection of the
    block's short-convolved input (at a value token it holds the key; needs `short_conv` >= 2).
    `memory_input` "residual" feeds the memory the residual stream after attention, "conv" the
    block's normed (and short-convolved) input that attention sees. `route_input` is what the
    addresses (the read route and, under "previous", the write route) are computed from:
    "pre_conv" the block's normed input before the short convolution, which a convolution has not
    mixed with the tokens before it, so a key routes alike at its pair and at its query (in the first
    block, where attention has not mixed it either); "embedding" the token's embedding, RMS-normed by
    a norm of the memory's own, the same token identity in every block; "memory" the memory's own
    input (`memory_input`). The memory's query phases and writes always come from
    `memory_input`. `balance_loss` > 0 adds that
    weight times a Switch-style load-balancing loss per tree level to the training loss;
    `decay_routing` false exempts the anchors and the write and address projections from weight
    decay.
    """

    window: int = 64
    memory_every: int = 1
    branching: int = 4
    depth: int = 3
    memory_dim: int = 64
    segment_len: int = 256
    route_temperature: float = 0.1
    update_memory_train: bool = True
    update_memory_eval: bool = True
    collision_scope: Literal["sequence", "segment", "none"] = "sequence"
    scan_backend: Literal["auto", "reference", "torch", "triton"] = "auto"
    memory_horizon: int = 0
    routing: Literal["learned", "router", "hash"] = "learned"
    write_address: Literal["current", "previous", "conv"] = "current"
    memory_input: Literal["residual", "conv"] = "residual"
    route_input: Literal["pre_conv", "embedding", "memory"] = "embedding"
    balance_loss: float = 0.0
    decay_routing: bool = True

    def __post_init__(self) -> None:
        for key in ("window", "depth", "memory_dim", "segment_len"):
            check_range(key, getattr(self, key), low=1)
        check_range("balance_loss", self.balance_loss, low=0, note=" (0 disables it)")
        if self.routing == "hash" and self.balance_loss > 0:
            raise ValueError(f"balance_loss: fixed-hash routing has nothing to balance (routing: hash), got "
                             f"{self.balance_loss}; set it to 0")
        check_range("memory_horizon", self.memory_horizon, low=0, note=" (0: the phases are never reset)")
        check_range("memory_every", self.memory_every, low=0, note=" (0 disables the memory)")
        check_range("branching", self.branching, low=2)
        check_range("route_temperature", self.route_temperature, low=0, low_open=True)
        for key, allowed in _ROUTING_CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}: must be one of {', '.join(map(repr, allowed))}, got {getattr(self, key)!r}")

    @property
    def n_slots(self) -> int:
        """Slots in the tree with its root: 1 + N + N^2 + ... + N^depth."""
        return (self.branching ** (self.depth + 1) - 1) // (self.branching - 1)


_ROUTING_CHOICES = {key: get_args(typing.get_type_hints(PMNetConfig)[key])
                    for key in ("routing", "write_address", "memory_input", "route_input")}
"""The values each routing switch accepts, read from its Literal annotation: checked when a PMNetConfig is
built directly (a YAML config is checked by the loader already)."""


@dataclasses.dataclass
class ModelConfig:
    """Architecture of one causal language model.

    `kind` picks the family; the shared fields size it. `short_conv` (K tokens, 0 = none) puts a
    causal depthwise convolution before every block's sequence mixer (model/blocks.py). Family-specific
    settings live in their own sections so that a config names only what it changes.
    """

    kind: ModelKind = "transformer"
    vocab_size: int = 258
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    max_seq_len: int = 4096
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    short_conv: int = 0
    vort: VortConfig = dataclasses.field(default_factory=VortConfig)
    pmnet: PMNetConfig = dataclasses.field(default_factory=PMNetConfig)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            check_range(key, getattr(self, key), low=1)
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: must divide d_model={self.d_model}, got {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"n_heads: head dim d_model/n_heads must be even (rotary), got {self.n_heads}")
        check_range("mlp_ratio", self.mlp_ratio, low=0, low_open=True)
        check_range("short_conv", self.short_conv, low=0, note=" (0 for none)")
        check_range("init_std", self.init_std, low=0, low_open=True)
        if self.kind == "pmnet" and self.pmnet.write_address == "conv" and self.short_conv < 2:
            raise ValueError(f"short_conv: pmnet.write_address=conv routes the writes from the short-convolved "
                             f"input, so it needs short_conv >= 2 (the token before each one), got {self.short_conv}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def load_model_config(path: str | Path) -> ModelConfig:
    """The `model:` section of a YAML file (following `extends`), checked as a run's config is."""
    tree, sources = read_tree(path)
    section = tree.get("model")
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: expected a `model:` mapping, got {section!r}")
    return model_config_from_dict(section, sources)


PREDATED_KEYS: dict[str, dict[str, dict[str, Any]]] = {
    "pmnet": {"pmnet": {"route_input": "memory"}},
}
"""Per model kind, keys added after models were saved without them, with the value that reproduces what
those models computed (a saved PMNet without `route_input` routed from the memory's input; the
default is now `embedding`, docs/results.md section 12)."""


def as_trained(section: dict[str, Any]) -> dict[str, Any]:
    """A `model:` section read back from a run, a checkpoint or an export, with every key it predates
    (PREDATED_KEYS) set to what the model was trained with, not to today's default; so an old run
    resumes, exports and evaluates as the model it is, and a start with another value is refused."""
    filled = dict(section)
    for group, keys in PREDATED_KEYS.get(section.get("kind", ""), {}).items():
        saved = filled.get(group) if isinstance(filled.get(group), dict) else {}
        filled[group] = {**keys, **saved}
    return filled


def model_config_from_dict(section: dict[str, Any], sources: dict[str, str] | None = None) -> ModelConfig:
    """A plain `model:` section (e.g. an export's `lm_config`) checked into a ModelConfig; errors
    name keys as `model.<key>`, as they would in a run config."""
    return build_config(ModelConfig, section, sources, prefix="model")
