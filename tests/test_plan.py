"""pretrain.plan: the activation probe is reproducible and sees what checkpointing saves, a probe that
dies is reported instead of waited on, and the command shards weights and optimizer as the engine does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import build_model
from pretrain import plan
from pretrain.config import load_config

REPO = Path(__file__).resolve().parents[1]
SP_VORT = str(REPO / "configs" / "sp-cpu-vort.yaml")


def per_token(cfg, checkpointing: bool, tokens: int) -> float:
    return (plan.measure(cfg, checkpointing, 2 * tokens, 1) - plan.measure(cfg, checkpointing, tokens, 1)) / tokens


def test_probe_is_reproducible_and_sees_checkpointing() -> None:
    cfg = load_config(SP_VORT, [])
    plain = [per_token(cfg, False, 1024) for _ in range(2)]
    checkpointed = per_token(cfg, True, 1024)
    assert plain[0] > 0
    assert plain[1] == pytest.approx(plain[0], rel=0.1), plain
    assert checkpointed < 0.8 * min(plain), (checkpointed, plain)


def test_a_probe_that_dies_is_reported() -> None:
    cfg = load_config(SP_VORT, [])
    with pytest.raises(RuntimeError, match=r"probe of 1 x 0 tokens .* exited with code 1"):
        plan.measure(cfg, False, 0, 1)


def test_plan_command_shards_state_and_says_whether_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["engine.zero_stage=1", "data.seq_len=4096"]
    args = ["--config", SP_VORT, "--world", "4", "--probe-tokens", "256", *overrides]
    assert plan.main([*args, "--gpu-mem", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "2048 tokens per rank" in out and "world 4" in out
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in build_model(load_config(SP_VORT, overrides).model).parameters())
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()
            if line.split() and line.split()[0] in ("params", "optimizer", "activations", "reduce_bucket")}
    # ZeRO-1 over 4 ranks, fp32: every rank holds the weights, a quarter of AdamW's two moments and
    # DeepSpeed's whole gradient-reduction bucket
    assert rows["params"][0] == pytest.approx(n_params * 4 / 2**30, abs=0.006)
    assert rows["optimizer"][0] == pytest.approx(n_params * 8 / 4 / 2**30, abs=0.006)
    assert rows["activations"][0] > 0
    assert rows["reduce_bucket"][0] == pytest.approx(plan.DEEPSPEED_REDUCE_BUCKET * 4 / 2**30, abs=0.006)
    assert out.splitlines()[-1].split()[-2:] == ["fits", "fits"]
    assert plan.main([*args, "--gpu-mem", "1MiB"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].count("does NOT fit") == 2


@pytest.mark.parametrize(("extra", "message"), [
    (["--gpu-mem", "eighty"], "--gpu-mem: expected a size like 80GiB"),
    (["--world", "3"], "--world 3 is not a multiple of engine.sequence_parallel=2"),
])
def test_plan_command_refuses_bad_arguments(extra: list[str], message: str, capsys) -> None:
    assert plan.main(["--config", SP_VORT, *extra]) == 2
    assert message in capsys.readouterr().err
