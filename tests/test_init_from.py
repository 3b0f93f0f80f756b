"""init.from: a fresh run starts from another run's weights only, at another seq_len, with a fresh
optimizer, step counter and data stream, from a run, checkpoint or export directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.pretrain import EXIT_BAD_INPUT, main
from model import build_model
from pretrain.checkpoint.consolidate import consolidate, read_run_config, resolve_checkpoint
from pretrain.config import ConfigError, load_config
from pretrain.export import export
from pretrain.run.init_from import load_initial_weights
from tests.launchers import run_training

REPO = Path(__file__).resolve().parents[1]
TINY_VORT = str(REPO / "configs" / "tiny-vort.yaml")


def overrides(shards: dict[str, str], run: Path, *extra: str) -> list[str]:
    return [f"data.train=[{{path: {shards['train']}}}]", f"data.valid=[{shards['valid']}]", f"run.dir={run}",
            "checkpoint.async_save=false", *extra]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory, demo_shards: dict[str, str]) -> Path:
    """6 steps of the tiny VORT at seq_len 64: the short-context run the long one starts from."""
    run = tmp_path_factory.mktemp("short") / "run"
    assert main(["--config", TINY_VORT, *overrides(demo_shards, run, "train.steps=6")]) == 0
    return run


def trained_weights(run: Path) -> dict[str, torch.Tensor]:
    step = resolve_checkpoint(run)
    return {k: v.detach() for k, v in consolidate(step, read_run_config(step)).named_parameters()}


def test_long_run_starts_from_the_short_runs_weights_only(
    short_run: Path, demo_shards: dict[str, str], tmp_path: Path
) -> None:
    source = trained_weights(short_run)
    long = tmp_path / "long"
    # lr 1e-30 keeps one update below fp32 resolution: the saved weights are the loaded ones
    extra = ["train.steps=1", "train.lr=1e-30", "train.warmup_steps=0", "data.seq_len=128",
             "model.max_seq_len=128", f"init.from={short_run}"]
    assert main(["--config", TINY_VORT, *overrides(demo_shards, long, *extra)]) == 0

    step_dir = long / "checkpoints" / "step_00000001"  # step 1: the counter restarted at 0
    assert (long / "checkpoints" / "latest").read_text() == "step_00000001"
    weights = trained_weights(long)
    assert weights.keys() == source.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, source[name], rtol=0, atol=1e-12, msg=name)
    assert any(not torch.equal(v, build_model(read_run_config(step_dir).model).state_dict()[k])
               for k, v in weights.items())  # not a fresh initialisation either

    # a fresh AdamW: one step taken, not the short run's 6 + 1
    optimizer = torch.load(step_dir / "engine" / "optimizer.pt", weights_only=True)
    assert {int(s["step"]) for s in optimizer["state"].values()} == {1}
    # a fresh stream at the new length: one step of global_batch sequences consumed
    state = json.loads((step_dir / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == 1
    assert state["data"]["seq_len"] == 128 and state["data"]["consumed"] == 8


def test_checkpoint_and_export_directories_give_the_same_weights(short_run: Path, tmp_path: Path) -> None:
    source = trained_weights(short_run)
    exported = export(short_run, tmp_path / "export")
    step_dir = resolve_checkpoint(short_run)
    cfg = load_config(TINY_VORT, ["data.seq_len=128", "model.max_seq_len=128"])
    for where in (short_run, short_run / "checkpoints", step_dir, exported):
        model = build_model(cfg.model)
        load_initial_weights(model, str(where))
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.detach(), source[name], rtol=0, atol=0, msg=f"{where}: {name}")
    assert set(load_file(str(exported / "model.safetensors"))) >= set(source)


def test_bad_sources_name_init_from(short_run: Path, tmp_path: Path, demo_shards: dict[str, str]) -> None:
    wider = build_model(load_config(TINY_VORT, ["model.d_model=48"]).model)
    with pytest.raises(ConfigError, match=r"init.from: .* do not fit .*mix_norm.weight \[64\] saved, \[48\] here"):
        load_initial_weights(wider, str(short_run))
    with pytest.raises(ConfigError, match=r"init.from: .*nowhere: no such checkpoint"):
        load_initial_weights(build_model(load_config(TINY_VORT).model), str(tmp_path / "nowhere"))
    run = tmp_path / "run"
    args = ["--config", TINY_VORT, *overrides(demo_shards, run, f"init.from={tmp_path / 'nowhere'}")]
    assert main(args) == EXIT_BAD_INPUT
    assert not (run / "metrics.jsonl").exists()


def test_the_shipped_recipe_pair_extends_the_4k_run() -> None:
    """configs/vort-125m-128k.yaml starts from configs/vort-125m.yaml's run: same model but its length."""
    short = load_config(REPO / "configs" / "vort-125m.yaml")
    long = load_config(REPO / "configs" / "vort-125m-128k.yaml")
    assert long.init.from_ == short.run.dir and short.init.from_ is None
    assert (short.data.seq_len, long.data.seq_len) == (4096, 131072)
    assert dataclasses.replace(long.model, max_seq_len=short.model.max_seq_len) == short.model


def test_a_sharded_two_rank_run_starts_from_a_single_process_runs_weights(
    short_run: Path, demo_shards: dict[str, str], tmp_path: Path
) -> None:
    """Another engine and world size: the one-process run's weights seed a 2-rank ZeRO-3 run (weights
    sharded after the load) at a longer seq_len; its checkpoint, consolidated, holds those weights."""
    source = trained_weights(short_run)
    long = tmp_path / "long"
    extra = ["train.steps=1", "train.lr=1e-30", "train.warmup_steps=0", "data.seq_len=128", "model.max_seq_len=128",
             "engine.kind=deepspeed", "engine.zero_stage=3", f"init.from={short_run}"]
    run_training("deepspeed", 2, ["--config", TINY_VORT, *overrides(demo_shards, long, *extra)])
    weights = trained_weights(long)
    assert weights.keys() == source.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, source[name], rtol=0, atol=1e-12, msg=name)
    state = json.loads((long / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == 1 and state["data"]["seq_len"] == 128
