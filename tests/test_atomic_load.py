"""A checkpoint that does not load changes nothing: on each real engine, loading another model's
checkpoint, or a same-shaped one with a file cut short, is refused with a CheckpointError and leaves
every weight and optimizer tensor of the engine exactly as it was (tests/load_atomic_worker.py does
the work under the launcher the engine runs with; see its docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launchers import REPO, run_training

WORKER = str(REPO / "tests" / "load_atomic_worker.py")
DEEPSPEED = ["engine.kind=deepspeed", "engine.zero_stage={stage}"]
CASES = {  # launcher, ranks, engine overrides, the other model, the files to cut short
    "single": ("python", 1, ["engine.kind=single"], ["model.n_layers=3"], ["optimizer.pt"]),
    "deepspeed-zero2": ("deepspeed", 2, ["engine.kind=deepspeed", "engine.zero_stage=2"], ["model.d_model=64"],
                        ["ds/*optim_states.pt"]),
    "deepspeed-zero3": ("deepspeed", 2, ["engine.kind=deepspeed", "engine.zero_stage=3"], ["model.n_layers=3"],
                        ["ds/zero_pp_rank_1_*optim_states.pt"]),
    "fsdp": ("torchrun", 2, ["engine.kind=fsdp"], ["model.d_model=64"], ["__1_0.distcp"]),  # rank 1's file only
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_load_leaves_the_engine_untouched(case: str, tmp_path: Path) -> None:
    launcher, ranks, engine, other_model, damage = CASES[case]
    args = ["--saved-with", *engine, *other_model, "--loaded-into", *engine, "--damage", *damage]
    proc = run_training(launcher, ranks, [str(tmp_path), *args], timeout=300, entry=WORKER)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    other, damaged = result["errors"]["other"], result["errors"]["damaged"]
    assert str(tmp_path / "other") in other and "does not fit this run's model" in other, other
    assert str(tmp_path / "damaged") in damaged and "Error" not in damaged.split(":")[0], damaged
    assert result["tensors"] > 20 and result["same_names"]
    assert result["changed"] == [], result["changed"]
