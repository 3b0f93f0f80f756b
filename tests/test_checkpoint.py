"""Checkpoints: atomic commit, verification and fallback, fsspec roots, async errors, pruning."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pytest
import torch

from model import build_model
from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.layout import CheckpointError
from pretrain.checkpoint.manifest import verify
from pretrain.config import load_config
from pretrain.engines import SingleEngine, TrainModule

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def make_engine(seed: int) -> SingleEngine:
    cfg = load_config(TINY, ["model.d_model=32", "model.n_layers=1"])
    torch.manual_seed(seed)
    return SingleEngine(cfg, TrainModule(build_model(cfg.model)), gas=1)


def train_a_step(engine: SingleEngine) -> None:
    x = torch.randint(0, 258, (2, 16))
    engine.train_step([(x, x)], lr=1e-2)


def weights(engine: SingleEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.model.parameters()]


def save_steps(ckpt: Checkpointer, engine: SingleEngine, steps: list[int]) -> dict[int, list[torch.Tensor]]:
    saved = {}
    for step in steps:
        train_a_step(engine)
        ckpt.save(step, engine, {"trainer": {"step": step}, "data": {"consumed": step}}, "run: {}\n")
        saved[step] = weights(engine)
    ckpt.wait()
    return saved


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_restores_model_optimizer_and_state(tmp_path: Path, async_save: bool) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), tmp_path / "stage", 3, 0, async_save)
    engine = make_engine(0)
    saved = save_steps(ckpt, engine, [1, 2])
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"
    fresh = make_engine(1)
    state = ckpt.resume("auto", fresh)
    assert state["trainer"]["step"] == 2 and state["data"] == {"consumed": 2} and state["world_size"] == 1
    for a, b in zip(saved[2], weights(fresh)):
        assert torch.equal(a, b)


def test_optimizer_moments_survive_the_round_trip(tmp_path: Path) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), tmp_path / "stage", 3, 0, False)
    engine = make_engine(0)
    save_steps(ckpt, engine, [1])
    fresh = make_engine(1)
    ckpt.resume("auto", fresh)
    x = torch.randint(0, 258, (2, 16))
    engine.train_step([(x, x)], lr=1e-2)
    fresh.train_step([(x, x)], lr=1e-2)
    for a, b in zip(weights(engine), weights(fresh)):
        assert torch.equal(a, b)


def test_corrupt_newest_is_reported_and_skipped(tmp_path: Path, caplog) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), tmp_path / "stage", 5, 0, False)
    engine = make_engine(0)
    saved = save_steps(ckpt, engine, [1, 2])
    target = tmp_path / "ckpt" / "step_00000002" / "engine" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-10] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        verify(tmp_path / "ckpt" / "step_00000002")
    fresh = make_engine(1)
    with caplog.at_level(logging.WARNING, logger="recurrent"):
        state = ckpt.resume("auto", fresh)
    assert state["trainer"]["step"] == 1
    assert "step_00000002" in caplog.text and "sha256" in caplog.text
    for a, b in zip(saved[1], weights(fresh)):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError):
        ckpt.resume(str(tmp_path / "ckpt" / "step_00000002"), fresh)  # an explicit path is not skipped


def test_writer_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(REPO / "tests")!r})
        from test_checkpoint import make_engine, save_steps
        from pretrain.checkpoint.checkpointer import Checkpointer
        engine = make_engine(0)
        ckpt = Checkpointer({str(root)!r}, {str(tmp_path)!r}, 5, 0, False)
        save_steps(ckpt, engine, [1])
        real_save = engine.save
        def dying_save(path):
            real_save(path)
            with open(os.path.join(path, "model.safetensors"), "r+b") as f:
                f.truncate(100)  # half-written file, then the process dies
            os._exit(137)
        engine.save = dying_save
        save_steps(ckpt, engine, [2])
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 137, proc.stderr
    assert (root / "step_00000002.tmp").exists() and not (root / "step_00000002").exists()
    assert (root / "latest").read_text() == "step_00000001"
    state = Checkpointer(str(root), tmp_path, 5, 0, False).resume("auto", make_engine(3))
    assert state["trainer"]["step"] == 1


def test_fsspec_root_memory_filesystem(tmp_path: Path) -> None:
    root = "memory://ckpt-test/run"
    ckpt = Checkpointer(root, tmp_path / "stage", 2, 2, True)
    engine = make_engine(0)
    saved = save_steps(ckpt, engine, [1, 2, 3, 4])
    fs = fsspec.filesystem("memory")
    assert ckpt.list() == ["step_00000004", "step_00000003", "step_00000002"]  # 2 kept + milestone 2
    assert fs.cat_file("/ckpt-test/run/latest").decode() == "step_00000004"
    assert not list((tmp_path / "stage").glob("step_*"))  # staging cleaned after upload
    fresh = make_engine(1)
    state = ckpt.resume("auto", fresh)
    assert state["trainer"]["step"] == 4
    for a, b in zip(saved[4], weights(fresh)):
        assert torch.equal(a, b)
    fs.rm("/ckpt-test", recursive=True)


def test_local_pruning_keeps_last_and_milestones(tmp_path: Path) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), tmp_path / "stage", 2, 3, False)
    save_steps(ckpt, make_engine(0), [1, 2, 3, 4, 5, 6, 7])
    assert ckpt.list() == ["step_00000007", "step_00000006", "step_00000003"]


def test_background_save_error_surfaces_in_the_loop(tmp_path: Path, monkeypatch) -> None:
    ckpt = Checkpointer(str(tmp_path / "ckpt"), tmp_path / "stage", 2, 0, True)

    def failing_commit(stage: Path, step: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_commit", failing_commit)
    engine = make_engine(0)
    ckpt.save(1, engine, {"trainer": {"step": 1}, "data": {}}, "")
    with pytest.raises(CheckpointError, match="disk full"):
        ckpt.wait()
