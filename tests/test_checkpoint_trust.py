"""Checkpoints from files we did not write: a code-executing pickle planted in any file of a
checkpoint (its manifest rewritten to match) runs nothing through export, init.from or resume,
and each refuses naming the file; verification needs the manifest to list exactly the files there;
`latest` is only a hint; a checkpoint that verifies but does not load stops a resume, and is skipped
by export and init.from."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.consolidate import resolve_checkpoint
from pretrain.checkpoint.dcp_format import safe_load
from pretrain.checkpoint.layout import MANIFEST, CheckpointError
from pretrain.checkpoint.manifest import manifest_for, verify
from pretrain.config import ConfigError, config_from_dict, config_text, config_to_dict, load_config
from pretrain.export import ExportError, export
from pretrain.export import main as export_main
from pretrain.run.init_from import read_initial_weights
from tests.test_checkpoint import make_engine, save_steps

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickled, it creates the file `marker`: a stand-in for any code a hostile file could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return open, (self.marker, "w")


def reseal(step_dir: Path) -> None:
    """Rewrite the manifest so the directory verifies again: what anyone who can write files can do."""
    step = json.loads((step_dir / MANIFEST).read_text())["step"]
    (step_dir / MANIFEST).unlink()
    (step_dir / MANIFEST).write_text(json.dumps(manifest_for(step_dir, step)))
    verify(step_dir)


def dcp_engine_dir(engine_dir: Path, seed: int) -> None:
    """Replace a single-engine payload by the FSDP engine's format: a DCP checkpoint of "model"
    (TrainModule's names) and "optim" entries, with non-tensor (bytes) items among the latter."""
    engine = make_engine(seed)
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(engine_dir)
    model = {f"model.{k}": v for k, v in engine.model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "optim": {"lr": 1e-3, "betas": (0.9, 0.95)}}, checkpoint_id=str(engine_dir),
                 no_dist=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory whose checkpoints/ holds steps 1 and 2 of a tiny single-engine run."""
    root = tmp_path_factory.mktemp("trust") / "run"
    save_steps(Checkpointer(str(root / "checkpoints"), root / "stage", 5, 0, False), make_engine(0), [1, 2])
    return root


def hostile_copy(run_dir: Path, tmp_path: Path, plant: str, fsdp: bool) -> tuple[Path, Path]:
    """A copy of the run whose newest step holds the payload in file `plant` (relative to the step
    directory), resealed; returns (run copy, marker path)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step_dir = copy / "checkpoints" / "step_00000002"
    if fsdp:
        dcp_engine_dir(step_dir / "engine", 0)
    marker = tmp_path / "ran"
    target = step_dir / plant
    if target.name == ".metadata" or target.suffix != ".pt":
        target.write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"state": {}, "param_groups": [], "extra": Payload(marker)}, target)
    reseal(step_dir)
    return copy, marker


PLANTS = [
    ("engine/.metadata", True), ("engine/__0_0.distcp", True), ("engine/optimizer.pt", False),
    ("rng/rank_0.safetensors", False), ("rng/rank_0.json", False), ("trainer_state.json", False),
]


def resume_fsdp_payload(engine_dir: Path, tmp_path: Path) -> None:
    """What FSDPEngine.load does with `engine_dir` (load_dcp_state), here on an unsharded module:
    it must refuse the planted file with a CheckpointError naming the directory."""
    import torch.distributed as dist

    from model import build_model
    from pretrain.checkpoint.dcp_format import load_dcp_state
    from pretrain.engines import TrainModule

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ["model.d_model=32", "model.n_layers=1"])
    module = TrainModule(build_model(cfg.model))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError, match=re.escape(str(engine_dir))), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_dcp_state(str(engine_dir), module, torch.optim.AdamW(module.parameters()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("plant", "fsdp"), PLANTS)
def test_planted_payload_runs_nowhere_and_is_named(
    plant: str, fsdp: bool, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy, marker = hostile_copy(run_dir, tmp_path, plant, fsdp)
    step_dir = copy / "checkpoints" / "step_00000002"
    weights_file = plant.startswith("engine/")
    if weights_file:  # export and init.from read only the weights: they refuse the planted ones
        assert export_main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(step_dir / "engine") in err, err
        with pytest.raises(ConfigError, match=r"init\.from: .*engine"):
            read_initial_weights(str(step_dir))
    if fsdp:  # resume through the FSDP engine's reader, in a process group of one
        resume_fsdp_payload(step_dir / "engine", tmp_path)
    if not fsdp:
        ckpt = Checkpointer(str(copy / "checkpoints"), tmp_path / "stage", 5, 0, False)
        for mode in (str(step_dir), "auto"):  # "auto" too: it verifies, so it is refused, not skipped
            with pytest.raises(CheckpointError, match=re.escape(str(step_dir / plant))):
                ckpt.resume(mode, make_engine(1))
    assert not marker.exists(), "the planted payload ran"


def test_dcp_items_are_read_weights_only(tmp_path: Path) -> None:
    """A non-tensor DCP item holding a payload: the stock reader runs it, ours refuses it."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": {"hostile": Payload(marker)}}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        with pytest.raises(CheckpointError, match=r"c: .*'optim\.hostile': not plain data.*io\.open"):
            safe_load({"optim": {"hostile": None}}, str(tmp_path / "c"), no_dist=True)
        assert not marker.exists()
        dcp.load({"optim": {"hostile": None}}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert marker.exists(), "the stock planner did not run the payload: the test plants nothing"


def test_deepspeed_files_are_read_weights_only(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step_dir = copy / "checkpoints" / "step_00000002"
    shutil.rmtree(step_dir / "engine")
    (step_dir / "engine" / "ds").mkdir(parents=True)
    (step_dir / "engine" / "format.json").write_text(json.dumps({"zero_stage": 0, "data_parallel_size": 1}))
    marker = tmp_path / "ran"
    torch.save({"module": {}, "extra": Payload(marker)}, step_dir / "engine" / "ds" / "mp_rank_00_model_states.pt")
    reseal(step_dir)
    assert export_main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "out")]) == 2
    with pytest.raises(ConfigError, match=r"init.from: .*engine/ds"):
        read_initial_weights(str(step_dir))
    assert not marker.exists()


@pytest.mark.parametrize("change", ["empty", "unlisted", "missing", "outside"])
def test_manifest_must_list_exactly_the_files(change: str, run_dir: Path, tmp_path: Path) -> None:
    step_dir = tmp_path / "step_00000002"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", step_dir)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    if change == "empty":
        manifest["files"] = {}
        expected = "lists no files"
    elif change == "unlisted":
        del manifest["files"]["trainer_state.json"]
        expected = "trainer_state.json: not listed"
    elif change == "missing":
        (step_dir / "config.yaml").unlink()
        expected = "config.yaml: listed in the manifest but missing"
    else:
        (tmp_path / "x").write_text("x")
        manifest["files"]["../x"] = {"bytes": 1, "sha256": "0"}
        expected = "outside the step directory"
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=expected):
        verify(step_dir)
    (step_dir / "extra.bin").write_bytes(b"\0")
    manifest = manifest_for(step_dir, 2)
    (step_dir / "late.bin").write_bytes(b"\0")
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"late\.bin: not listed"):
        verify(step_dir)


def test_latest_is_only_a_hint(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    checkpoints = copy / "checkpoints"
    foreign = tmp_path / "foreign"
    shutil.copytree(checkpoints / "step_00000001", foreign)
    shutil.copytree(checkpoints / "step_00000002", checkpoints / "step_00000003.tmp")
    for hint in (str(foreign), "../../foreign", "step_00000003.tmp", "step_00000001"):
        (checkpoints / "latest").write_text(hint)
        assert resolve_checkpoint(copy) == checkpoints / "step_00000002"
    weights = checkpoints / "step_00000002" / "engine" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # the newest no longer verifies
    assert resolve_checkpoint(copy) == checkpoints / "step_00000001"
    (checkpoints / "step_00000001" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="no committed checkpoint verifies"):
        resolve_checkpoint(copy)
    with pytest.raises(CheckpointError, match="uncommitted"):
        resolve_checkpoint(checkpoints / "step_00000003.tmp")


def test_export_of_a_foreign_checkpoint_exits_2_with_one_line(run_dir: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "step_00000002"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", foreign)
    (foreign / MANIFEST).unlink()
    proc = subprocess.run([sys.executable, "-m", "pretrain.export", "--checkpoint", str(foreign), "--out",
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[")]  # DeepSpeed's import banner
    assert len(lines) == 1 and str(foreign) in lines[0] and "manifest.json" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_that_verifies_but_does_not_load_is_refused_not_skipped(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step_dir = copy / "checkpoints" / "step_00000002"
    (step_dir / "trainer_state.json").write_text("[]")  # valid JSON, not a trainer state
    reseal(step_dir)
    ckpt = Checkpointer(str(copy / "checkpoints"), tmp_path / "stage", 5, 0, False)
    engine, fresh = make_engine(1), make_engine(1)
    for mode in ("auto", str(step_dir)):
        with pytest.raises(CheckpointError, match=r"step_00000002: verified but does not load .*nothing was loaded: "
                                                  r".*trainer_state\.json: expected a JSON object"):
            ckpt.resume(mode, engine)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), fresh.model.parameters()))


def test_init_from_and_export_fall_back_past_a_checkpoint_that_does_not_load(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    text = config_text(load_config(str(REPO / "configs" / "tiny.yaml"), ["model.d_model=32", "model.n_layers=1"]))
    for step_dir in (copy / "checkpoints").glob("step_*"):  # the config make_engine's model was built from
        (step_dir / "config.yaml").write_text(text)
        reseal(step_dir)
    newest = copy / "checkpoints" / "step_00000002"
    (newest / "engine" / "model.safetensors").unlink()  # verifies once resealed, holds no known payload
    (newest / "engine" / "optimizer.pt").unlink()
    (newest / "engine" / "note.txt").write_text("not a payload")
    reseal(newest)
    expected = read_initial_weights(str(copy / "checkpoints" / "step_00000001"))
    got = read_initial_weights(str(copy))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    with pytest.raises(ConfigError, match=r"init.from: .*step_00000002/engine: holds no engine payload"):
        read_initial_weights(str(newest))  # named directly: not replaced by another
    exported = export(copy, tmp_path / "export")  # export takes the same way past it
    assert json.loads((exported / "config.json").read_text())["recurrent_export"]["step"] == 1
    with pytest.raises(ExportError, match=r"step_00000002/engine: holds no engine payload"):
        export(newest, tmp_path / "export_newest")


def test_export_contacts_nothing_a_checkpoint_config_names(run_dir: Path, tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    step_dir = copy / "checkpoints" / "step_00000002"
    cfg = config_to_dict(load_config(str(REPO / "configs" / "tiny.yaml"), ["model.d_model=32", "model.n_layers=1"]))
    cfg["data"]["train"] = [{"path": f"{url}/shards", "weight": 1.0}]
    (step_dir / "config.yaml").write_text(config_text(config_from_dict(cfg)))
    reseal(step_dir)
    exported = export(step_dir, tmp_path / "bytes")  # byte tokenizer: only the data fingerprint is remote
    assert "not computed" in json.loads((exported / "config.json").read_text())["recurrent_export"]["data_fingerprint"]
    cfg["data"]["tokenizer"] = f"{url}/sp.model"
    (step_dir / "config.yaml").write_text(config_text(config_from_dict(cfg)))
    reseal(step_dir)
    with pytest.raises(ExportError, match=r"data.tokenizer=.*remote .*--allow-network"):
        export(step_dir, tmp_path / "sp")
    with pytest.raises(BlockingIOError):  # nobody knocked
        listener.accept()
    listener.close()
