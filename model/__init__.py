"""Model families behind one builder; training code sees only `build_model`, `family` and `CausalLM`."""

from __future__ import annotations

from collections.abc import Callable

from model.config import ModelConfig
from model.interface import IGNORE_INDEX, CausalLM, LMOutput, SequenceParallel

__all__ = ["IGNORE_INDEX", "CausalLM", "LMOutput", "ModelConfig", "SequenceParallel", "build_model", "family"]


def _transformer() -> type[CausalLM]:
    from model.transformer import Transformer

    return Transformer


def _pmnet() -> type[CausalLM]:
    from model.pmnet import PMNet

    return PMNet


def _vort() -> type[CausalLM]:
    from model.vort import VortLM

    return VortLM


FAMILIES: dict[str, Callable[[], type[CausalLM]]] = {
    "transformer": _transformer,
    "pmnet": _pmnet,
    "vort": _vort,
    "pl": _vort,
    "exp": _vort,
    "m5": _vort,
}


def family(kind: str) -> type[CausalLM]:
    """The class of the family named `kind` (`model.kind`): what callers ask about a family before
    building one (its capabilities are class attributes and class methods of CausalLM)."""
    if kind not in FAMILIES:
        raise ValueError(f"model.kind: unknown family {kind!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[kind]()


def build_model(config: ModelConfig) -> CausalLM:
    """Instantiate the family named by `config.kind` (weights initialised, fp32, on CPU)."""
    return family(config.kind)(config)
