"""pretrain.evaluate.memory_probe (what a VORT memory holds along the position) and pretrain.evaluate's
equal token budget per context."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from model import build_model
from model.soe.tables import bank_orders, certified_kernel
from pretrain.config import config_from_dict
from pretrain.evaluate import memory_probe as mp
from pretrain.evaluate import text as ev
from pretrain.export import write_export

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "data" / "demo" / "train" / "macbeth.txt"


@pytest.fixture(scope="module")
def vort_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = config_from_dict(yaml.safe_load((REPO / "configs" / "model" / "vort-tiny.yaml").read_text()))
    torch.manual_seed(0)
    return write_export(build_model(cfg.model), cfg, tmp_path_factory.mktemp("exports") / "vort")


def test_kernel_table_recent_share_matches_the_closed_forms() -> None:
    """Order 1 weighs every lag 1, so the last L of T lags hold L/T of the mass, exactly; a lower
    order keeps more of its mass recent, and that share falls as the context grows."""
    cfg = config_from_dict(yaml.safe_load((REPO / "configs" / "model" / "vort-tiny.yaml").read_text())).model.vort
    kernel = certified_kernel(bank_orders(cfg), cfg.soe_horizon, cfg.soe_eps)
    rows = mp.kernel_table(kernel, cfg.soe_horizon, 64, [256, 1024])
    assert rows[-1]["alpha"] == 1.0
    assert rows[-1]["recent_share_exact"] == {"256": 0.25, "1024": 0.0625}
    assert rows[-1]["recent_share_soe"]["1024"] == pytest.approx(0.0625, rel=1e-6)
    shares = [r["recent_share_exact"]["1024"] for r in rows]
    assert shares == sorted(shares, reverse=True)
    assert all(r["recent_share_exact"]["1024"] < r["recent_share_exact"]["256"] for r in rows[:-1])
    assert rows[0]["soe_rel_error_beyond_horizon"] > 0  # lags past the 256-lag certificate drift


def test_probe_tracks_the_normaliser_and_writes_json(vort_export: Path, tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    png = tmp_path / "probe.png"
    assert mp.main(["--model", str(vort_export), "--data", str(BOOK), "--context", "512", "--chunk", "128",
                    "--train-len", "64", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    chunks = report["probe"]["chunks"]
    assert [c["end"] for c in chunks] == [128, 256, 384, 512]
    for layer in range(2):
        mass = [c["layers"][layer]["normaliser_mass"] for c in chunks]
        assert mass[-1] > mass[0] > 0  # the slow terms accumulate faster than the fast ones forget
        for c in chunks:
            entry = c["layers"][layer]
            assert 0 <= entry["order_one_share"] <= entry["long_term_share"] <= 1
            assert 0.1 <= entry["alpha_mean"] <= 1
    assert len(report["kernel"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_refuses_models_without_an_soe_state(tmp_path: Path) -> None:
    cfg = config_from_dict(yaml.safe_load((REPO / "configs" / "model" / "transformer-tiny.yaml").read_text()))
    with pytest.raises(ev.EvalError, match="transformer"):
        mp.probe(build_model(cfg.model), np.zeros(100, dtype=np.int64), 64, 32, 16)


def test_max_tokens_gives_every_context_the_same_tokens(vort_export: Path) -> None:
    report = ev.evaluate(vort_export, [str(BOOK)], [128, 512, 2048], chunk=256, max_tokens=2048)
    assert [r["windows"] for r in report["contexts"].values()] == [16, 4, 1]
    assert {r["tokens"] for r in report["contexts"].values()} == {2048}
    with pytest.raises(ev.EvalError, match="--max-tokens"):
        ev.evaluate(vort_export, [str(BOOK)], [128], max_tokens=0)


def test_soe_horizon_rebuilds_the_tables_and_keeps_the_weights(vort_export: Path) -> None:
    model = ev.load_exported(vort_export)
    rebuilt = model.with_kernel(soe_horizon=2048)
    assert rebuilt.config.vort.soe_horizon == 2048 != model.config.vort.soe_horizon
    for (name, a), (_, b) in zip(model.named_parameters(), rebuilt.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(model.blocks[0].mixer.memory.banks, rebuilt.blocks[0].mixer.memory.banks)
    torch.testing.assert_close(model.blocks[0].mixer.features.weight, rebuilt.blocks[0].mixer.features.weight)
    report = ev.evaluate(vort_export, [str(BOOK)], [512], chunk=256, max_windows=1, soe_horizon=2048)
    assert report["soe_horizon"] == 2048 and np.isfinite(report["contexts"]["512"]["bits_per_token"])
    tempered = model.with_kernel(temper=64)
    torch.testing.assert_close(tempered.blocks[0].mixer.memory.log_lambda,
                               model.blocks[0].mixer.memory.log_lambda - 1 / 64)
    with pytest.raises(ValueError, match="no certified memory kernel"):
        cfg = config_from_dict(yaml.safe_load((REPO / "configs" / "model" / "exp-tiny.yaml").read_text()))
        build_model(cfg.model).with_kernel(soe_horizon=2048)
