"""The names of a checkpoint's files, and the error raised for a checkpoint that cannot be used.

A run's checkpoints directory holds `step_<8 digits>/` directories (a `.tmp` suffix while one is
written, `.old-<n>` for a committed one renamed aside while the same step is re-saved, `.del` while
a pruned one is deleted) and a `latest` pointer, which is only a hint. A step directory holds:
  manifest.json        every other file with its size and sha256, written last: it marks completeness
  config.yaml          the resolved run config
  trainer_state.json   the loop's counters, the data loader's position and the world size
  rng/rank_<r>.json, rng/rank_<r>.safetensors   each rank's RNG states
  engine/              the engine's payload (one module per format beside this one)
"""

from __future__ import annotations

from pathlib import Path

import torch

MANIFEST = "manifest.json"
LATEST = "latest"
CONFIG = "config.yaml"
TRAINER_STATE = "trainer_state.json"
ENGINE_DIR = "engine"
RNG_DIR = "rng"
OLD_SUFFIX = ".old-"  # `<step>.old-<n>`: a committed step renamed aside while the same step is re-saved
DELETING_SUFFIX = ".del"  # `<step>.del`: a pruned step being deleted (never restored)
TMP_SUFFIX = ".tmp"  # `<step>.tmp`: a step being written (never restored)
MODEL_PREFIX = "model."  # the CausalLM's attribute name in engines.TrainModule, plus the dot


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete or corrupt."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_number(name: str) -> int:
    """The step of a step directory name (`step_00000012`, or one with a suffix)."""
    return int(name.split(".")[0].split("_")[1])


def old_number(names: list[str], name: str) -> int:
    """The next free n for `<name>.old-<n>` among the directory names `names`."""
    suffixes = [n[len(name + OLD_SUFFIX) :] for n in names if n.startswith(name + OLD_SUFFIX)]
    return max([int(s) for s in suffixes if s.isdigit()], default=0) + 1


def strip_model_prefix(state: dict[str, torch.Tensor], source: Path | str) -> dict[str, torch.Tensor]:
    """The CausalLM's own names for an engine state dict; raises naming `source` on a stray key."""
    odd = [k for k in state if not k.startswith(MODEL_PREFIX)]
    if odd:
        raise CheckpointError(f"{source}: parameter {odd[0]!r} is not under the engine's {MODEL_PREFIX!r} prefix")
    return {k[len(MODEL_PREFIX) :]: v for k, v in state.items()}


def cause(err: BaseException) -> str:
    """`err` in one line for a message naming a file: torch's weights-only refusal spans a
    paragraph whose telling line names the refused global."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    refused = [line for line in lines if "Unsupported global" in line]
    text = (refused or lines or [""])[0]
    return text if isinstance(err, CheckpointError) else f"{type(err).__name__}: {text}".rstrip(": ")
