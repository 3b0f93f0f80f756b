"""launch/experiment.py: every experiment's quick mode end to end, resume, parameter parity; the
synthetic-task registry and task data in the trainer."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import pretrain.trainer
from data_pipeline import synthetic
from experiments import EXPERIMENTS
from experiments.runner import Experiment, ExperimentError, Family, subset_name
from launch.experiment import main
from model import build_model
from pretrain.checkpoint.manifest import manifest_for
from pretrain.config import ConfigError, load_config
from pretrain.data import make_task_data
from pretrain.preflight import DataError

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


class Sleeper(Experiment):
    """An experiment whose runs note their worker's pid and then wait, as a long training would."""

    def train(self, family: Family, seed: int, out: Path, quick: bool) -> None:  # type: ignore[override]
        (out / f"{family.name}.pid").write_text(str(os.getpid()))
        time.sleep(120)


SLEEPER = Sleeper(name="sleeper", title="", config="copy.yaml", families=(Family("a"), Family("b")))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One output directory for the module, so experiments share runs as they do for users."""
    return tmp_path_factory.mktemp("experiments")


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_quick_mode_writes_results_and_resumes(name: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    experiment = EXPERIMENTS[name]
    assert main(["run", name, "--quick", "--out", str(out)]) == 0
    results = json.loads((out / name / "results.json").read_text())
    families = [f.name for f in experiment.families_for(quick=True)]
    assert [r["family"] for r in results["runs"]] == families and results["quick"]
    assert list(results["summary"]) == families
    for record in results["runs"]:
        assert record["metrics"] and record["train_tokens"] > 0
        assert (out / "runs").glob(f"*/{record['family']}/seed0/checkpoints")
    with (out / name / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {row["family"] for row in rows} == set(families)
    assert (out / name / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def no_training(*_args: object, **_kwargs: object) -> int:
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(pretrain.trainer, "train", no_training)
    assert main(["run", name, "--quick", "--out", str(out)]) == 0
    again = json.loads((out / name / "results.json").read_text())
    assert again["runs"] == results["runs"]


def test_parallel_training_gives_the_results_of_one_at_a_time(tmp_path: Path) -> None:
    """Two worker processes train the runs; every run's metrics equal those of one at a time."""
    assert main(["run", "entity", "--quick", "--seeds", "2", "--out", str(tmp_path)]) == 0
    sequential = json.loads((tmp_path / "entity" / "results.json").read_text())["runs"]
    parallel_out = tmp_path / "parallel"
    assert main(["run", "entity", "--quick", "--seeds", "2", "--out", str(parallel_out), "--parallel", "2"]) == 0
    parallel = json.loads((parallel_out / "entity" / "results.json").read_text())["runs"]
    assert [(r["family"], r["seed"]) for r in parallel] == [(r["family"], r["seed"]) for r in sequential]
    assert parallel == sequential
    assert main(["run", "entity", "--quick", "--out", str(parallel_out), "--parallel", "0"]) == 1


def test_a_curriculum_run_starts_from_its_first_stage(out: Path) -> None:
    """zipf-curriculum trains each family at 128 tokens first (zipf-dense.yaml), then at full length
    from those weights; the stage-1 run is the one zipf-check trains for its Transformer."""
    assert main(["run", "zipf-curriculum", "--quick", "--out", str(out), "--families", "transformer"]) == 0
    second_dir = out / "runs" / "zipf-curriculum-quick" / "transformer" / "seed0"
    second = yaml.safe_load((second_dir / "config.yaml").read_text())
    first = out / "runs" / "zipf-dense-quick" / "transformer-T128" / "seed0"
    assert second["init"]["from"] == str(first) and (first / "checkpoints").is_dir()
    assert second["data"]["seq_len"] == 512 and second["train"]["lr"] == 3e-3
    results = json.loads((out / "zipf-curriculum" / "transformer" / "results.json").read_text())
    assert results["runs"][0]["metrics"]["first_stage_loss_end"] > 0
    checked = EXPERIMENTS["zipf-check"]
    assert checked.run_config(checked.families[1], 0, out, True)[0] == first


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killing_a_parallel_launcher_stops_its_workers(tmp_path: Path) -> None:
    """A launcher killed outright (SIGKILL: no handler runs) leaves no worker training on."""
    script = ("from pathlib import Path\nfrom tests.test_experiments import SLEEPER\n"
              f"SLEEPER.train_all([(f, 0) for f in SLEEPER.families], Path({str(tmp_path)!r}), False, 2)\n")
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 120
    while len(pids := list(tmp_path.glob("*.pid"))) < 2 or not all(p.read_text() for p in pids):
        assert launcher.poll() is None and time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    workers = [int(p.read_text()) for p in pids]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while any(map(_running, workers)):
        assert time.monotonic() < deadline, f"workers {workers} still run after their launcher was killed"
        time.sleep(0.1)


def test_families_runs_only_those_and_keeps_the_whole_experiments_files(
    out: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--families reuses the module's runs of `entity` (trained by the quick-mode test above, or here),
    writes the subset under entity/<names> and leaves entity/results.json as the whole run wrote it."""
    assert main(["run", "entity", "--quick", "--out", str(out)]) == 0
    whole = (out / "entity" / "results.json").read_text()

    def no_training(*_args: object, **_kwargs: object) -> int:
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(pretrain.trainer, "train", no_training)
    assert main(["run", "entity", "--quick", "--out", str(out), "--families", "vort,pl"]) == 0
    subset = json.loads((out / "entity" / "pl+vort" / "results.json").read_text())
    assert [r["family"] for r in subset["runs"]] == ["pl", "vort"]
    assert subset["command"].endswith("--families pl,vort")
    assert (out / "entity" / "results.json").read_text() == whole
    assert subset_name([f"family-{i}" for i in range(20)]).startswith("family-0+19-more-")
    assert main(["run", "entity", "--quick", "--out", str(out), "--families", "pl,m5"]) == 1
    assert "--families: m5 not in entity; its families: pl, exp, vort" in capsys.readouterr().err


def test_set_changes_every_family_and_is_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--set KEY=VALUE goes into every family's config and into results.json's command; the plain
    run in the same --out refuses the variant's runs rather than mixing them."""
    args = ["run", "copy", "--quick", "--out", str(tmp_path), "--families", "pmnet,swa"]
    assert main([*args, "--set", "train.lr=1e-3", "--set", "model.pmnet.window=8"]) == 0
    results = json.loads((tmp_path / "copy" / "pmnet+swa" / "results.json").read_text())
    assert results["command"].endswith("--families pmnet,swa --set train.lr=1e-3 --set model.pmnet.window=8")
    for family in ("pmnet", "swa"):
        saved = yaml.safe_load((tmp_path / "runs" / "copy-quick" / family / "seed0" / "config.yaml").read_text())
        assert (saved["train"]["lr"], saved["model"]["pmnet"]["window"]) == (1e-3, 8)
    assert main(args) == 1
    assert "holds a run of another configuration" in capsys.readouterr().err


def test_a_run_from_before_a_new_option_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run saved before model.pmnet.memory_horizon existed (the key absent from its config.yaml) is
    the same run as one with the option at its default: it is reused, not refused or retrained."""
    experiment, family = EXPERIMENTS["copy"], Family("swa", ("model.pmnet.memory_every=0",))
    run = experiment.train(family, 0, tmp_path, quick=True)
    for saved in run.dir.rglob("config.yaml"):
        config = yaml.safe_load(saved.read_text())
        del config["model"]["pmnet"]["memory_horizon"]
        saved.write_text(yaml.safe_dump(config))
    for manifest in run.dir.rglob("checkpoints/step_*/manifest.json"):  # as the old run wrote them
        step = json.loads(manifest.read_text())["step"]
        manifest.unlink()
        manifest.write_text(json.dumps(manifest_for(manifest.parent, step)))
    monkeypatch.setattr(pretrain.trainer, "train", lambda *_a, **_k: pytest.fail("the run was trained again"))
    assert experiment.train(family, 0, tmp_path, quick=True).dir == run.dir


def test_a_changed_config_is_not_mixed_with_an_old_run(tmp_path: Path) -> None:
    experiment = EXPERIMENTS["copy"]
    experiment.train(Family("swa", ("model.pmnet.memory_every=0",)), 0, tmp_path, quick=True)
    with pytest.raises(ExperimentError, match="another configuration"):
        experiment.train(Family("swa", ("model.pmnet.memory_every=0", "train.lr=1e-3")), 0, tmp_path, quick=True)
    run_dir = experiment.run_config(Family("swa"), 0, tmp_path, quick=True)[0]
    (run_dir / "config.yaml").unlink()  # a checkpoint left by another configuration is caught as well
    with pytest.raises(ExperimentError, match="another configuration"):
        experiment.train(Family("swa", ("model.pmnet.memory_every=0", "train.lr=1e-3")), 0, tmp_path, quick=True)


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_families_compared_have_the_same_size_budget_and_optimizer(name: str, tmp_path: Path) -> None:
    experiment = EXPERIMENTS[name]
    for group in experiment.comparable_groups():
        configs = [experiment.run_config(f, 0, tmp_path, quick=False)[1] for f in group]
        sizes = [build_model(c.model).num_parameters() for c in configs]
        assert max(sizes) <= 1.05 * min(sizes), dict(zip([f.name for f in group], sizes))
        assert len({(c.train.steps, c.train.global_batch, c.data.seq_len) for c in configs}) == 1
        assert len({(c.train.lr, c.train.schedule, c.train.weight_decay, c.train.grad_clip) for c in configs}) == 1


def test_list_names_every_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPERIMENTS)


@pytest.mark.parametrize("name", sorted(synthetic.TASKS))
def test_registry_builds_every_task_at_its_minimum_length(name: str) -> None:
    haystack = b"Some plain text for the haystack.\n" * 20
    task = synthetic.make_task(name, synthetic.MIN_TASK_LEN, haystack=haystack)
    lengths = [task.example(i).input_ids.size for i in range(8)]
    assert max(lengths) <= task.max_len <= synthetic.MIN_TASK_LEN


def test_registry_builds_short_tasks_that_fit_and_refuses_those_that_do_not() -> None:
    task = synthetic.make_task("mqar", 64, vocab_size=128, num_pairs=8)
    assert task.example(0).input_ids.size == 64
    with pytest.raises(ValueError, match="task 'mqar' at 40 tokens: seq_len 40 too short for 16 pairs"):
        synthetic.make_task("mqar", 40, vocab_size=128, num_pairs=16)
    with pytest.raises(ValueError, match="task 'zipf' at 20 tokens: seq_len 20 too short"):
        synthetic.make_task("zipf", 20)


def test_registry_and_config_reject_unknown_tasks_and_bad_parameters() -> None:
    with pytest.raises(ValueError, match="unknown synthetic task 'sorting'"):
        synthetic.make_task("sorting", 256)
    with pytest.raises(ValueError, match="bad parameters"):
        synthetic.make_task("zipf", 256, num_keys=3)
    with pytest.raises(ConfigError, match=r"eval\.tasks: unknown"):
        load_config(TINY, ["eval.tasks=[sorting]"])
    with pytest.raises(ConfigError, match=r"data\.task\.name: unknown synthetic task"):
        load_config(TINY, ["data.train=[]", "data.task.name=sorting"])
    with pytest.raises(ConfigError, match=r"either data\.train"):
        load_config(TINY, ["data.task.name=zipf"])


def test_task_data_batches_resume_after_the_examples_consumed() -> None:
    cfg = load_config(TINY, ["data.train=[]", "data.task.name=zipf", "data.seq_len=128", "data.task.seed=5"])
    loader = make_task_data(cfg, 0, 1)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    expected = next(batches)
    resumed = make_task_data(cfg, 0, 1)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert torch.equal(got["input_ids"], expected["input_ids"]) and torch.equal(got["labels"], expected["labels"])
    assert got["input_ids"].shape == (cfg.train.micro_batch, 128)
    too_long = load_config(TINY, ["data.train=[]", "data.task.name=copy", "data.seq_len=128",
                                  "data.task.params={max_copy: 64, max_lookback: 100}"])
    with pytest.raises(DataError, match=r"more than data\.seq_len=128"):
        make_task_data(too_long, 0, 1)


def test_cache_floats_count_what_each_family_carries() -> None:
    """The MQAR grid's state size (CausalLM.cache_floats)."""
    vort = build_model(load_config(TINY, ["model.kind=exp", "model.short_conv=3"]).model)
    c = vort.config
    per_layer = c.n_heads * c.vort.n_features * (c.head_dim + 1) + 2 * c.d_model  # one exp term; conv tail
    assert vort.cache_floats(40) == c.n_layers * per_layer
    transformer = build_model(load_config(TINY, ["model.kind=transformer"]).model)
    c = transformer.config
    assert transformer.cache_floats(40) == 2 * 40 * c.d_model * c.n_layers  # the keys and values of a cache
