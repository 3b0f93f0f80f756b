"""The engines' throughput settings: foreach (CPU) AdamW, DeepSpeed overlap_comm with buckets sized to
the model, and train.compile honoured by the DeepSpeed engine rather than ignored."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

from pretrain.config import load_config
from pretrain.engines import DEEPSPEED_MAX_BUCKET, _adamw, deepspeed_bucket_elements, deepspeed_config

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def test_cpu_adamw_is_multi_tensor() -> None:
    optimizer = _adamw(load_config(TINY), nn.Linear(4, 4))
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


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
    """One DeepSpeed process with train.compile=true: the engine is compiled and a step trains."""
    script = textwrap.dedent(f"""
        import math, torch
        from model import build_model
        from pretrain.config import load_config
        from pretrain.engines import build_engine, init_distributed
        cfg = load_config({TINY!r}, ["engine.kind=deepspeed", "train.compile=true", "train.global_batch=2"])
        init_distributed(cfg)
        torch.manual_seed(0)
        engine = build_engine(cfg, build_model(cfg.model), 1)
        assert engine.engine.is_compiled
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
