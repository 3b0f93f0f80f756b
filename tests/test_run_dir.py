"""A run directory belongs to one run (pretrain/run/directory.py, pretrain/run/resume_rules.py), through the real
entry point, `python launch/pretrain.py`: a start that cannot continue the run in its directory exits 2
with one line naming the keys (old and new values) or the source and the ways forward, and leaves every
file of the directory byte for byte as it was; the changes a run may take are logged and trained; the
old run moves aside on --start-over; a finished run says so and changes nothing; the errors of bad
input say the fix; step lines show the time left; `python -m pretrain.telemetry.plot` draws a run's curves."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from model.config_loader import dump_yaml
from pretrain.config import config_to_dict, load_config, read_saved_config
from pretrain.run.resume_rules import RULES, compare, flatten, rule_for
from tests.launchers import REPO, run_training
from tests.test_checkpoint_trust import reseal

TINY = str(REPO / "configs" / "tiny.yaml")
TINY_VORT = str(REPO / "configs" / "tiny-vort.yaml")
TINY_PMNET = str(REPO / "configs" / "tiny-pmnet.yaml")
STEPS = 6


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path: the run directory byte for byte."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def args(shards: str, run: Path, *extra: str, config: str = TINY_VORT) -> list[str]:
    return ["--config", config, f"data.train=[{{path: {shards}}}]", "data.valid=[]", f"run.dir={run}",
            f"train.steps={STEPS}", "checkpoint.every=3", *extra]


def start(arguments: list[str]) -> tuple[int, str]:
    """Run launch/pretrain.py in one process; (exit code, stdout + stderr)."""
    proc = run_training("python", 1, arguments, timeout=300, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def refusal(code: int, output: str) -> str:
    """The one error line of a start that must have exited 2 without a traceback."""
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, demo_shards: dict[str, str]) -> Path:
    """A tiny VORT run of STEPS steps, checkpointed and evaluated every 3: the run directory others find."""
    run = tmp_path_factory.mktemp("finished") / "run"
    code, output = start([*args(demo_shards["train"], run), f"data.valid=[{demo_shards['valid']}]", "eval.every=3"])
    assert code == 0, output[-3000:]
    return run


@pytest.fixture
def used(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run (its recorded run.dir differs from the copy's: allowed, a moved run)."""
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


REFUSED = {  # what a start changes -> what its one line must say
    "another model": ((), TINY, ["model.kind 'vort' -> 'transformer'", "new run.dir", "init.from=", "--start-over"]),
    "seq_len": (("data.seq_len=32",), TINY_VORT, ["data.seq_len 64 -> 32", "init.from="]),
    "seed": (("run.seed=5",), TINY_VORT, ["run.seed 1234 -> 5", "seeds the sample order"]),
    "mixture": (("data.train=[{path: SHARDS, weight: 2.0}]",), TINY_VORT, ["data.train", "data.mixture_change=true"]),
    "optimizer": (("train.beta2=0.99",), TINY_VORT, ["train.beta2 0.95 -> 0.99", "would not apply"]),
    "resume none": (("--resume", "none"), TINY_VORT, ["checkpoints (newest step_00000006)", "--start-over",
                                                      "--resume auto"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_start_that_cannot_continue_the_run_is_refused_before_anything_is_touched(
    case: str, used: Path, demo_shards: dict[str, str]
) -> None:
    extra, config, fragments = REFUSED[case]
    extra = tuple(e.replace("SHARDS", demo_shards["train"]) for e in extra)
    before = tree(used)
    line = refusal(*start([*args(demo_shards["train"], used, config=config), "train.steps=9", *extra]))
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert tree(used) == before


def test_a_finished_run_started_again_says_it_is_complete_and_changes_nothing(
    used: Path, demo_shards: dict[str, str]
) -> None:
    before = tree(used)
    code, output = start(args(demo_shards["train"], used))
    assert code == 0 and f"{used}: this run is complete: step_00000006 is at step 6 of train.steps=6" in output
    assert "checkpoint of step" not in output and "step 6/6" not in output
    assert tree(used) == before


def test_allowed_changes_are_logged_and_trained_with_the_time_left(used: Path, demo_shards: dict[str, str]) -> None:
    extra = ["train.steps=9", "train.log_every=2", "train.global_batch=16", "eval.every=4", "log.wandb_project=x"]
    code, output = start([*args(demo_shards["train"], used), *extra])
    assert code == 0, output[-3000:]
    changes = re.search(r"resuming \S+ with changed settings: (.*)", output).group(1)
    for change in ("train.global_batch 8 -> 16", "train.log_every 1 -> 2", "train.steps 6 -> 9", "eval.every 3 -> 4",
                   "log.wandb_project 'recurrent-pretrain' -> 'x'", "run.dir"):
        assert change in changes, (change, changes)
    assert "resumed from" in output and "step_00000006" in output
    steps = [json.loads(line) for line in (used / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "train/loss" in r][-2:] == [8, 9]
    line = next(line for line in output.splitlines() if "step 8/9" in line)
    assert re.search(r"\| elapsed \d+(:\d\d)+, left ~\d+(:\d\d)+$", line), line
    assert load_config(used / "config.yaml").train.steps == 9


def test_start_over_moves_the_old_run_aside_and_starts_afresh(used: Path, demo_shards: dict[str, str]) -> None:
    before = {name: digest for name, digest in tree(used).items() if name != ".lock"}
    code, output = start([*args(demo_shards["train"], used, config=TINY), "train.steps=2", "--start-over"])
    assert code == 0, output[-3000:]
    aside = used.parent / "run.old-1"
    assert tree(aside) == before  # every file of the old run, as it was
    assert load_config(used / "config.yaml").model.kind == "transformer"
    assert sorted(p.name for p in (used / "checkpoints").glob("step_*")) == ["step_00000002"]
    steps = [json.loads(line)["step"] for line in (used / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_a_checkpoint_that_verifies_but_does_not_fit_is_refused_not_skipped(
    used: Path, demo_shards: dict[str, str]
) -> None:
    newest = used / "checkpoints" / "step_00000006"
    weights_file = newest / "engine" / "model.safetensors"
    weights = load_file(weights_file)
    dropped = sorted(weights)[0]
    del weights[dropped]
    save_file(weights, weights_file)
    reseal(newest)  # as someone who can write the files can
    before = tree(used)
    line = refusal(*start([*args(demo_shards["train"], used), "train.steps=9"]))
    assert f"{newest}: verified but does not load" in line and "nothing was loaded" in line, line
    assert f"1 tensor(s) missing from it ({dropped})" in line, line
    assert tree(used) == before


def _built(source: str, output: Path, *flags: str) -> None:
    subprocess.run([sys.executable, "-m", "data_pipeline.build", "--input", source, "--output", str(output),
                    "--no-progress", *flags], cwd=REPO, check=True, capture_output=True, timeout=300)


def test_shards_rebuilt_under_a_run_are_refused_unless_the_change_is_declared(tmp_path: Path) -> None:
    shards, run = tmp_path / "shards", tmp_path / "run"
    plays = REPO / "data" / "demo" / "train"
    _built(str(plays / "hamlet.txt"), shards)
    code, output = start(args(str(shards), run, "train.steps=3"))
    assert code == 0, output[-3000:]
    _built(str(plays / "macbeth.txt"), shards, "--overwrite")  # rebuilt in place from other text
    before = tree(run)
    line = refusal(*start(args(str(shards), run)))
    assert f"data.train[0] ({shards}): fingerprint" in line and "data.mixture_change=true" in line, line
    assert "rebuilt" in line and "step_00000003" in line, line
    assert tree(run) == before
    code, output = start([*args(str(shards), run), "data.mixture_change=true"])
    assert code == 0 and "rebuilt shards" in output, output[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["data.train=[{path: NOWHERE}]"], ["data.train[0].path: no shards at", "python -m data_pipeline.build",
                                            "--output NOWHERE"]),
        (["data.train.0.path=NOWHERE"], ["data.train is a list", "e.g. data.train='[{path: "]),
        (["trian.lr=3e-4"], ["<command line>: trian: unknown key"]),
    ],
)
def test_bad_input_says_the_fix(extra: list[str], fragments: list[str], tmp_path: Path) -> None:
    nowhere = str(tmp_path / "nowhere")
    arguments = ["--config", TINY, f"run.dir={tmp_path / 'run'}", *(e.replace("NOWHERE", nowhere) for e in extra)]
    line = refusal(*start(arguments))
    for fragment in fragments:
        assert fragment.replace("NOWHERE", nowhere) in line, (fragment, line)
    assert not (tmp_path / "run").exists()


def test_every_config_key_has_a_resume_rule_and_the_docs_list_them() -> None:
    cfg = load_config(TINY_VORT, ["data.task={name: mqar}", "data.train=[]"])
    for key in flatten(config_to_dict(cfg)) | flatten(config_to_dict(load_config(TINY_VORT))):
        rule_for(key)  # raises for a key no rule covers
    docs = (REPO / "docs" / "training.md").read_text()
    section = docs.split("### What may change on resume")[1].split("\n#")[0]
    rows = dict(re.findall(r"^\| `([a-z0-9_.]+)` \| ([^|]+) \|", section, re.MULTILINE))
    assert {key: rule.when for key, rule in RULES.items()} == {key: when.strip() for key, when in rows.items()}


def test_global_batch_and_data_changes_follow_train_carry_state() -> None:
    saved = config_to_dict(load_config(TINY_VORT))
    refused, allowed = compare(saved, load_config(TINY_VORT, ["train.global_batch=16"]))
    assert not refused and [c.key for c in allowed] == ["train.global_batch"]
    carried = config_to_dict(load_config(TINY_VORT, ["train.carry_state=true"]))
    refused, _ = compare(carried, load_config(TINY_VORT, ["train.carry_state=true", "train.global_batch=16"]))
    assert [c.key for c in refused] == ["train.global_batch"]
    moved = ["train.carry_state=true", "data.train=[{path: x}]", "data.mixture_change=true"]
    refused, _ = compare(carried, load_config(TINY_VORT, moved))
    assert [c.key for c in refused] == ["data.train"]


def _predating_route_input(path: Path) -> None:
    """Rewrite a saved config.yaml as a run saved before model.pmnet.route_input existed wrote it."""
    saved = yaml.safe_load(path.read_text())
    del saved["model"]["pmnet"]["route_input"]
    path.write_text(dump_yaml(saved))


def test_a_key_added_since_a_run_was_saved_takes_the_value_the_run_was_trained_with(tmp_path: Path) -> None:
    """A PMNet saved before `route_input` existed routed from the memory's input: read back, it says
    `memory` (not today's default, `embedding`), so a start with the default is refused naming the key
    and one with `memory` continues; a VORT run saved then is not affected (the key does not apply)."""
    for name, config in (("pmnet", TINY_PMNET), ("vort", TINY_VORT)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(dump_yaml(config_to_dict(load_config(config, ["model.pmnet.route_input=memory"]))))
        _predating_route_input(path)
        saved = read_saved_config(path)
        refused, _ = compare(saved, load_config(config))
        if name == "pmnet":
            assert saved["model"]["pmnet"]["route_input"] == "memory"
            assert [str(change) for change in refused] == ["model.pmnet.route_input 'memory' -> 'embedding'"]
            assert compare(saved, load_config(config, ["model.pmnet.route_input=memory"]))[0] == []
        else:
            assert refused == []


def test_a_pmnet_run_saved_before_route_input_resumes_as_trained(tmp_path: Path, demo_shards: dict[str, str]) -> None:
    """Through launch/pretrain.py: a PMNet run whose config.yaml and checkpoint predate `route_input`
    (rewritten so) is refused with today's default, untouched, and resumes with `route_input: memory`
    (the weights fit: the embedding route's norm is not in them)."""
    run = tmp_path / "run"
    first = [*args(demo_shards["train"], run, config=TINY_PMNET), "train.steps=3", "model.pmnet.route_input=memory"]
    code, output = start(first)
    assert code == 0, output[-3000:]
    newest = run / "checkpoints" / "step_00000003"
    for path in (run / "config.yaml", newest / "config.yaml"):
        _predating_route_input(path)
    reseal(newest)
    before = tree(run)
    line = refusal(*start([*args(demo_shards["train"], run, config=TINY_PMNET), "train.steps=6"]))
    assert "model.pmnet.route_input 'memory' -> 'embedding'" in line, line
    assert tree(run) == before
    code, output = start([*args(demo_shards["train"], run, config=TINY_PMNET), "train.steps=6",
                          "model.pmnet.route_input=memory"])
    assert code == 0 and "step 6/6" in output, output[-3000:]
    assert "resumed from" in output and "step_00000003 at step 3" in output, output[-3000:]


def test_plot_draws_loss_throughput_and_eval_curves_from_a_real_run(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, "-m", "pretrain.telemetry.plot", str(finished), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[0] > 200 and image.shape[1] > 400 and torch.from_numpy(image).std() > 0
    for drawn in ("train/loss (6 steps)", "perf/tokens_per_s (6 steps)", "eval/bits_per_token@64 (2 steps)"):
        assert drawn in proc.stdout, proc.stdout


def test_a_file_only_one_rank_reads_stops_every_rank_before_the_engine_loads(
    tmp_path: Path, demo_shards: dict[str, str]
) -> None:
    """Rank 1's RNG file does not load: both ranks stop (rank 0 must not enter the collective engine
    load alone, where it would wait for rank 1 until the timeout), and the directory is unchanged."""
    run = tmp_path / "run"
    fsdp = [*args(demo_shards["train"], run, "engine.kind=fsdp", "train.steps=3"), "engine.dist_timeout_s=120"]
    run_training("torchrun", 2, fsdp)
    newest = run / "checkpoints" / "step_00000003"
    (newest / "rng" / "rank_1.json").write_text(json.dumps({"python": [], "numpy": []}))
    reseal(newest)
    before = tree(run)
    proc = run_training("torchrun", 2, [*fsdp, "train.steps=6"], check=False, timeout=100)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank_1.json: not the RNG states this program saves" in output, output[-3000:]
    assert "another rank failed to load it" in output and "Traceback" not in proc.stdout, output[-3000:]
    assert tree(run) == before
