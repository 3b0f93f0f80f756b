"""The trainer in one process: schedules, parameter groups, bad input, NaN policy, a short run."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from launch.pretrain import EXIT_BAD_INPUT, main
from model import ModelConfig, build_model
from model.blocks import StackedLM
from pretrain.config import ConfigError, TrainSection, load_config
from pretrain.engines import SingleEngine, TrainModule
from pretrain.optim import lr_at, param_groups
from pretrain.preflight import grad_accumulation_steps

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def data_overrides(shards: dict[str, str], run_dir: Path) -> list[str]:
    return [f"data.train=[{{path: {shards['train']}}}]", f"data.valid=[{shards['valid']}]", f"run.dir={run_dir}"]


def test_cosine_schedule_warms_up_then_decays_to_floor() -> None:
    t = TrainSection(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine")
    lrs = [lr_at(s, t) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lr_at(100, t) == pytest.approx(0.1)


def test_wsd_schedule_is_flat_then_linear() -> None:
    t = TrainSection(steps=100, warmup_steps=0, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, t) == 1.0 and lr_at(80, t) == pytest.approx(1.0)
    assert lr_at(90, t) == pytest.approx(0.5) and lr_at(100, t) == pytest.approx(0.0)


def test_no_weight_decay_on_norms_biases_embeddings() -> None:
    model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and "embed" not in names[id(p)] for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"embed.weight", "norm.weight"}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


class NanOnMarker(torch.nn.Module):
    """A model whose loss is NaN when the batch starts with token 0 (an injected fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss, _ = self.model.loss(input_ids, labels)
        return loss * math.nan if int(input_ids[0, 0]) == 0 else loss


def test_nonfinite_loss_skips_the_update_exactly() -> None:
    cfg = load_config(TINY, ["train.global_batch=2", "train.micro_batch=2"])
    torch.manual_seed(0)
    module = NanOnMarker()
    engine = SingleEngine(cfg, module, gas=1)
    good = torch.randint(1, 258, (2, 16))
    bad = good.clone()
    bad[0, 0] = 0
    before = {k: v.clone() for k, v in module.state_dict().items()}
    info = engine.train_step([(bad, bad)], lr=1e-2)
    assert not info.applied and math.isnan(info.loss)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    for moments in engine.optimizer.state.values():  # AdamW's moments and step count untouched too
        assert moments["step"] == 0 and not moments["exp_avg"].any() and not moments["exp_avg_sq"].any()
    info = engine.train_step([(good, good)], lr=1e-2)
    assert info.applied and math.isfinite(info.grad_norm)
    assert any(not torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_gradient_accumulation_matches_one_big_batch() -> None:
    cfg = load_config(TINY)
    x = torch.randint(0, 258, (4, 16))
    results = []
    for gas in (1, 2):
        torch.manual_seed(0)
        engine = SingleEngine(cfg, TrainModule(build_model(cfg.model)), gas)
        chunks = [(x[i : i + 4 // gas], x[i : i + 4 // gas]) for i in range(0, 4, 4 // gas)]
        info = engine.train_step(chunks, lr=1e-2)
        results.append((float(info.grad_norm), [p.detach().clone() for p in engine.model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        # the first AdamW update is about lr * sign(grad): compare to a thousandth of lr
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_global_batch_must_split_over_the_ranks() -> None:
    cfg = load_config(TINY, ["train.global_batch=6", "train.micro_batch=3"])
    assert grad_accumulation_steps(cfg, 1) == 2 and grad_accumulation_steps(cfg, 2) == 1
    expected = r"global_batch=6 .* 4 data-parallel ranks .* multiple of data_parallel_size \* micro_batch = 12"
    with pytest.raises(ValueError, match=expected):
        grad_accumulation_steps(cfg, 4)


def run_bad(args: list[str], capsys: pytest.CaptureFixture, run_dir: Path) -> str:
    code = main(args)
    assert code == EXIT_BAD_INPUT
    assert not (run_dir / "metrics.jsonl").exists()  # stopped before any work
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_bad_input_stops_before_compute(tmp_path: Path, demo_shards: dict[str, str], capsys) -> None:
    run = tmp_path / "run"
    ok = data_overrides(demo_shards, run)
    assert "config file not found" in run_bad(["--config", str(tmp_path / "none.yaml")], capsys, run)
    assert "train.lrr" in run_bad(["--config", TINY, *ok, "train.lrr=1"], capsys, run)
    missing = [f"data.train=[{{path: {tmp_path / 'nowhere'}}}]", f"run.dir={run}"]
    message = run_bad(["--config", TINY, *missing], capsys, run)
    assert "data.train[0].path" in message and "nowhere" in message
    message = run_bad(["--config", TINY, *ok, "model.vocab_size=300"], capsys, run)
    assert "model.vocab_size=300" in message and "258" in message
    message = run_bad(["--config", TINY, *ok, "data.tokenizer=some.model"], capsys, run)
    assert "data.tokenizer" in message and "some.model" in message



def test_an_edited_manifest_stops_the_start_with_exit_2(tmp_path: Path, demo_shards: dict[str, str], capsys) -> None:
    train = tmp_path / "train"
    shutil.copytree(demo_shards["train"], train)
    manifest = json.loads((train / "manifest.json").read_text())
    manifest["total_tokens"] += 1
    (train / "manifest.json").write_text(json.dumps(manifest))
    run = tmp_path / "run"
    message = run_bad(["--config", TINY, *data_overrides({**demo_shards, "train": str(train)}, run)], capsys, run)
    assert str(train) in message and "total_tokens" in message
    assert len([line for line in message.splitlines() if "ERROR" in line]) == 1


def test_short_single_process_run_learns_and_writes_run_dir(tmp_path: Path, demo_shards: dict[str, str]) -> None:
    run = tmp_path / "run"
    haystack = REPO / "data" / "demo" / "valid" / "northangerabbey.txt"
    tasks = ["eval.tasks=[copy, needle, zipf]", "eval.task_len=128", "eval.task_examples=2"]
    tasks.append(f"eval.haystack={haystack}")
    overrides = [*data_overrides(demo_shards, run), "eval.every=10", "checkpoint.every=10", *tasks]
    assert main(["--config", TINY, *overrides]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5
    assert all(r["perf/tokens_per_s"] > 0 and 0 < r["perf/mfu"] < 1 for r in records if "perf/mfu" in r)
    assert any("eval/bits_per_token@64" in r for r in records)
    task_scores = [v for r in records for k, v in r.items() if k.endswith(("_exact", "_token_accuracy"))]
    assert len(task_scores) == 2 * 3 * 2 and all(0 <= v <= 1 for v in task_scores)  # 2 evals x 3 tasks
    assert load_config(run / "config.yaml") == load_config(TINY, overrides)
    assert (run / "checkpoints" / "latest").read_text() == "step_00000020"


@pytest.mark.parametrize("family", ["vort", "pl", "exp", "m5", "pmnet", "transformer"])
def test_every_family_has_only_parameters_deepspeed_can_broadcast(family: str) -> None:
    """DeepSpeed broadcasts parameters as byte views, which fails for 0-dim tensors."""
    model = build_model(load_config(str(REPO / "configs" / "model" / f"{family}-tiny.yaml")).model)
    assert [n for n, p in model.named_parameters() if p.ndim == 0] == []


def test_doc_boundaries_reach_the_model(tmp_path: Path, demo_shards: dict[str, str], monkeypatch) -> None:
    """With data.doc_boundaries every training micro-batch gives the model the stream's doc_start."""
    seen: list[torch.Tensor | None] = []
    hidden_states = StackedLM.hidden_states

    def spy(self, input_ids, state=None, sequence_parallel=None, doc_start=None):
        if self.training:
            seen.append(doc_start)
        return hidden_states(self, input_ids, state, sequence_parallel, doc_start)

    monkeypatch.setattr(StackedLM, "hidden_states", spy)
    overrides = [*data_overrides(demo_shards, tmp_path / "run"), "data.doc_boundaries=true", "train.steps=2"]
    assert main(["--config", TINY, *overrides]) == 0
    assert len(seen) == 2 * 4  # steps x micro-batches
    assert all(d is not None and d.dtype == torch.bool and d.shape == (2, 64) for d in seen)


def test_doc_boundaries_with_carried_states_reach_the_model(tmp_path: Path, demo_shards: dict[str, str],
                                                            monkeypatch) -> None:
    """Under train.carry_state the lanes' doc_start reaches the model with the carried state, and the states
    carry positions within the current document: a lane's next window continues them."""
    seen: list[tuple[torch.Tensor | None, object]] = []
    hidden_states = StackedLM.hidden_states

    def spy(self, input_ids, state=None, sequence_parallel=None, doc_start=None):
        out = hidden_states(self, input_ids, state, sequence_parallel, doc_start)
        if self.training:
            seen.append((doc_start, out[1][0].offset))
        return out

    monkeypatch.setattr(StackedLM, "hidden_states", spy)
    overrides = [*data_overrides(demo_shards, tmp_path / "run"), "data.doc_boundaries=true", "train.carry_state=true",
                 "train.steps=2", "model.kind=exp", "data.valid=[]", "eval.every=0"]
    assert main(["--config", TINY, *overrides]) == 0
    assert len(seen) == 2 * 4  # steps x micro-batches

    def position_after(doc_start: torch.Tensor, before: torch.Tensor | int) -> torch.Tensor:
        last_start = torch.where(doc_start, torch.arange(64), -1).max(1).values
        return torch.where(last_start >= 0, 64 - last_start, before + 64)

    for (doc_start, first), (later_start, later) in zip(seen[:4], seen[4:], strict=True):
        assert doc_start.dtype == torch.bool and doc_start.shape == later_start.shape == (2, 64)
        assert torch.equal(first, position_after(doc_start, 0))  # step 1 starts every lane afresh
        assert torch.equal(later, position_after(later_start, first))  # step 2 continues the lanes


def test_doc_boundaries_refuse_the_segment_scope_under_sequence_parallelism() -> None:
    sp = REPO / "configs" / "sp-cpu-pmnet.yaml"
    load_config(sp, ["data.doc_boundaries=true"])
    with pytest.raises(ConfigError, match=r"data.doc_boundaries=true: model.pmnet.collision_scope=segment"):
        load_config(sp, ["data.doc_boundaries=true", "model.pmnet.collision_scope=segment"])
