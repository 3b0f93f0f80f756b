"""Model families behind one builder; training code sees only `build_model` and `CausalLM`."""

from __future__ import annotations

from collections.abc import Callable

from model.config import ModelConfig
from model.interface import IGNORE_INDEX, CausalLM, LMOutput, SequenceParallel

__all__ = ["IGNORE_INDEX", "CausalLM", "LMOutput", "ModelConfig", "SequenceParallel", "build_model"]


def _transformer(config: ModelConfig) -> CausalLM:
    from model.transformer import Transformer

    return Transformer(config)


def _pmnet(config: ModelConfig) -> CausalLM:
    from model.pmnet import PMNet

    return PMNet(config)


def _vort(config: ModelConfig) -> CausalLM:
    from model.vort import VortLM

    return VortLM(config)


FAMILIES: dict[str, Callable[[ModelConfig], CausalLM]] = {
    "transformer": _transformer,
    "pmnet": _pmnet,
    "vort": _vort,
    "pl": _vort,
    "exp": _vort,
    "m5": _vort,
}


def build_model(config: ModelConfig) -> CausalLM:
    """Instantiate the family named by `config.kind` (weights initialised, fp32, on CPU)."""
    if config.kind not in FAMILIES:
        raise ValueError(f"model.kind: unknown family {config.kind!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[config.kind](config)
