"""The engines' throughput settings: fused AdamW, DeepSpeed overlap_comm with buckets sized to
the model, and train.compile honoured by the DeepSpeed engine rather than ignored."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from pretrain.config import load_config
from pretrain.engines import DEEPSPEED_MAX_BUCKET, _adamw, deepspeed_bucket_elements, deepspeed_config

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def test_adamw_is_fused() -> None:
    """Fused on every device: the CPU kernel too honours found_inf, which the engines' skip relies on."""
    optimizer = _adamw(load_config(TINY), nn.Linear(4, 4))
    assert optimizer.defaults["fused"] is True


@pytest.mark.parametrize(("n_params", "bucket"), [
    (10_000, 2**20),  # floor: one bucket for a tiny model
    (124_158_726, 31_039_681),  # the 125M VORT: about four buckets per backward
    (8_000_000_000, DEEPSPEED_MAX_BUCKET),  # DeepSpeed's default is the cap
])
def test_deepspeed_buckets_scale_with_the_model(n_params: int, bucket: int) -> None:
    assert deepspeed_bucket_elements(n_params) == bucket
    zero = deepspeed_config(load_config(TINY, ["engine.zero_stage=2"]), 1, 8, n_params)["zero_optimization"]
    assert zero["overlap_comm"] is True
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == bucket
    stage0 = deepspeed_config(load_config(TINY, ["engine.zero_stage=0"]), 1, 8, n_params)["zero_optimization"]
    assert stage0["overlap_comm"] is False


@pytest.mark.slow
def test_deepspeed_engine_compiles_when_asked(tmp_path: Path) -> None:
    """One DeepSpeed process with train.compile=model: the engine is compiled (DeepSpeed's engine.compile)
    and a step trains; with train.compile=true (blocks, the default) it is not, its blocks' forwards are."""
    script = textwrap.dedent(f"""
        import math, torch
        from model import build_model
        from pretrain.config import load_config
        from pretrain.engines import build_engine, join_process_group
        cfg = load_config({TINY!r}, ["engine.kind=deepspeed", "train.compile=model", "train.global_batch=2"])
        join_process_group(cfg)
        torch.manual_seed(0)
        engine = build_engine(cfg, build_model(cfg.model), 1)
        assert engine.engine.is_compiled
        blocks = load_config({TINY!r}, ["engine.kind=deepspeed", "train.compile=true", "train.global_batch=2"])
        by_block = build_engine(blocks, build_model(blocks.model), 1)
        assert not by_block.engine.is_compiled
        assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in by_block.model.blocks)
        ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
        info = engine.train_step([(ids[:, :-1], ids[:, 1:])], 1e-3)
        assert info.applied and math.isfinite(info.loss), info
        print("compiled step", info.loss)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_PORT": "29731"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compiled step" in done.stdout


HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__")
"""The ways a tensor's value reaches the host; on a GPU each waits for all the work queued before it."""


def test_the_loop_reads_the_device_only_at_log_steps(tmp_path: Path, demo_shards: dict[str, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Six steps logged every third: every host read of a tensor made by the trainer's or the engines'
    own code is recorded with the step it follows; none happens inside a step, none after a step that
    is not logged, and the log steps do read (so the spy sees what it must)."""
    import pretrain.data as data
    import pretrain.engines as engines
    import pretrain.trainer as trainer
    import pretrain.validate as validate
    from launch.pretrain import main

    watched = {engines.__file__, trainer.__file__, data.__file__, validate.__file__}
    progress = {"steps": 0, "in_step": False}
    reads: list[tuple[int, bool, str, int]] = []

    def spy_on(name: str):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename in watched:
                reads.append((progress["steps"], progress["in_step"], name, caller.f_lineno))
            return original(self, *args, **kwargs)
        return spy
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, spy_on(name))
    step = engines.SingleEngine.train_step

    def counted(self, *args, **kwargs):
        progress["in_step"] = True
        info = step(self, *args, **kwargs)
        progress["steps"] += 1
        progress["in_step"] = False
        return info
    monkeypatch.setattr(engines.SingleEngine, "train_step", counted)
    overrides = [f"data.train=[{{path: {demo_shards['train']}}}]", f"data.valid=[{demo_shards['valid']}]",
                 f"run.dir={tmp_path / 'run'}",
                 "train.steps=6", "train.log_every=3", "train.global_batch=2", "train.micro_batch=2"]
    assert main(["--config", TINY, *overrides]) == 0
    assert not [r for r in reads if r[1]], f"host reads inside a step: {[r for r in reads if r[1]]}"
    after = {steps for steps, _, _, _ in reads}
    unlogged = [r for r in reads if r[0] not in {0, 3, 6}]
    assert not unlogged, f"host reads after steps that are not logged: {unlogged}"
    assert {3, 6} <= after


@pytest.mark.slow
def test_deepspeed_skips_a_nonfinite_step_on_the_device(tmp_path: Path) -> None:
    """One DeepSpeed process at ZeRO stages 0 and 2: a step whose loss is NaN (a hook poisons the
    logits) leaves every weight as it was (stage 0 through AdamW's found_inf flag, stage 2 through
    ZeRO's overflow check) and reports itself skipped; the next good step applies."""
    script = textwrap.dedent(f"""
        import math, torch
        from model import build_model
        from pretrain.config import load_config
        from pretrain.engines import build_engine, join_process_group
        poison = {{"on": False}}
        for stage in (0, 2):
            cfg = load_config({TINY!r}, ["engine.kind=deepspeed", f"engine.zero_stage={{stage}}",
                                         "train.global_batch=2", "train.micro_batch=2"])
            join_process_group(cfg)
            torch.manual_seed(0)
            model = build_model(cfg.model)
            model.head.register_forward_hook(lambda m, i, out: out * math.nan if poison["on"] else out)
            engine = build_engine(cfg, model, 1)
            ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
            batch = [(ids[:, :-1], ids[:, 1:])]
            before = [p.detach().clone() for p in engine.model.parameters()]
            poison["on"] = True
            info = engine.train_step(batch, 1e-2)
            assert not bool(info.applied) and math.isnan(float(info.loss)), (stage, info)
            assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters())), stage
            poison["on"] = False
            info = engine.train_step(batch, 1e-2)
            assert bool(info.applied) and math.isfinite(float(info.grad_norm)), (stage, info)
            assert not all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters())), stage
            print("stage", stage, "skipped then applied")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_PORT": "29733"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "stage 2 skipped then applied" in done.stdout
