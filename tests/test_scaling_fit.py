"""The scaling-law fit: planted constants are recovered inside their intervals; bad results files
are refused with a message naming the file, line and column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from launch.sweep import main as sweep_main
from pretrain.sweeps.scaling import (
    EXPONENT_MAX,
    PARAMETERS,
    ScalingFitError,
    fit_parametric,
    fit_results,
    load_results,
    optimal_allocation,
    predict_loss,
)

# Two families with different constants (the first close to Chinchilla's published fit).
PLANTED = {
    "alpha-family": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28},
    "beta-family": {"E": 2.10, "A": 120.0, "B": 900.0, "alpha": 0.25, "beta": 0.40},
}
BUDGETS = np.geomspace(1e18, 1e21, 5)
NOISE = 0.004  # standard deviation of the multiplicative noise on the loss


def write_planted(path: Path, seed: int = 0) -> None:
    """An isoFLOP design (7 model sizes per budget, 4x either side of the planted optimum, as a sweep
    that brackets the optimum has) with noisy planted losses, C = 6ND."""
    rng = np.random.default_rng(seed)
    lines = ["family,params,tokens,loss,flops,budget"]
    for family, true in PLANTED.items():
        for budget in BUDGETS:
            centre = optimal_allocation(true, np.array([budget]), 6.0)[0][0]
            for n in centre * np.geomspace(1 / 4, 4, 7):
                d = budget / (6 * n)
                loss = predict_loss(true, n, d) * np.exp(rng.normal(0, NOISE))
                lines.append(f"{family},{n:.6g},{d:.6g},{loss:.8g},{budget:.6g},{budget:.6g}")
    path.write_text("\n".join(lines) + "\n")


def test_fit_recovers_planted_constants_and_intervals_cover_them(tmp_path: Path) -> None:
    results = tmp_path / "planted.csv"
    write_planted(results)
    fits = fit_results(load_results(results), bootstrap=100, seed=1)
    for family, true in PLANTED.items():
        fit = fits[family]
        assert fit["n_points"] == len(BUDGETS) * 7
        for key in PARAMETERS:
            lo, hi = fit["ci"][key]
            assert lo <= true[key] <= hi, f"{family} {key}: {true[key]} outside [{lo}, {hi}] (fit {fit[key]})"
        assert fit["alpha"] == pytest.approx(true["alpha"], abs=0.03)
        assert fit["beta"] == pytest.approx(true["beta"], abs=0.03)
        assert fit["E"] == pytest.approx(true["E"], rel=0.05)
        # compute-optimal exponents: the isoFLOP parabolas agree with the planted a = beta / (alpha + beta)
        a_true = true["beta"] / (true["alpha"] + true["beta"])
        iso = fit["isoflop"]
        assert iso["n_budgets"] == len(BUDGETS)
        assert iso["N_exponent"] == pytest.approx(a_true, abs=0.05)
        assert iso["N_exponent"] + iso["D_exponent"] == pytest.approx(1.0, abs=0.02)  # C = 6ND exactly here
    # the two families are told apart: their exponent intervals do not overlap
    a, b = fits["alpha-family"]["ci"]["beta"], fits["beta-family"]["ci"]["beta"]
    assert a[1] < b[0]


def test_isoflop_leaves_out_a_budget_whose_curve_locates_no_minimum(tmp_path: Path) -> None:
    """A nearly straight isoFLOP curve has its parabola's vertex thousands of e-folds away; that
    budget is left out (it used to overflow exp() in the fit or its bootstrap), the others fit."""
    write_planted(tmp_path / "planted.csv")
    lines = [line for line in (tmp_path / "planted.csv").read_text().splitlines() if "beta-family" not in line]
    flat_budget = 5e21
    for n in np.geomspace(1e9, 1e10, 5):
        loss = 2.0 + 0.01 * np.log(n) + 1e-6 * np.log(n) ** 2  # vertex at log N = -5000
        lines.append(f"alpha-family,{n:.6g},{flat_budget / (6 * n):.6g},{loss:.8g},{flat_budget:.6g},{flat_budget:.6g}")
    (tmp_path / "with_flat.csv").write_text("\n".join(lines) + "\n")
    iso = fit_results(load_results(tmp_path / "with_flat.csv"), bootstrap=50, seed=0)["alpha-family"]["isoflop"]
    assert iso["n_budgets"] == len(BUDGETS)
    assert flat_budget not in [m["flops"] for m in iso["minima"]]
    assert all(np.isfinite(v) for v in iso["ci"]["N_exponent"] + iso["ci"]["D_exponent"])


def test_an_undetermined_exponent_stops_at_its_bound_and_is_reported() -> None:
    """Loss that depends on N only through one step between the two smallest sizes: any alpha large
    enough fits, so the fit runs to the bound, says so, and every constant stays finite."""
    rng = np.random.default_rng(0)
    n, d = np.repeat([1e4, 2e4, 4e4, 8e4], 4), np.tile([1e6, 2e6, 4e6, 8e6], 4)
    loss = (2.0 + 50 / d**0.3 + np.where(n < 1.5e4, 0.5, 0.0)) * np.exp(rng.normal(0, 0.002, n.size))
    fit = fit_parametric(n, d, loss, bootstrap=20)
    assert fit["alpha"] == pytest.approx(EXPONENT_MAX) and fit["at_bound"] == ["alpha"]
    assert fit["beta"] == pytest.approx(0.3, abs=0.05)
    assert all(np.isfinite(fit[k]) and np.isfinite(fit["ci"][k]).all() for k in PARAMETERS)


def test_fit_command_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "planted.csv"
    write_planted(results)
    out, plots = tmp_path / "fit.json", tmp_path / "plots"
    assert sweep_main(["fit", "--results", str(results), "--json", str(out), "--plots", str(plots),
                       "--bootstrap", "10", "--starts", "10"]) == 0
    fit = json.loads(out.read_text())
    assert set(fit) == set(PLANTED)
    for family_fit in fit.values():
        assert {"E", "A", "B", "alpha", "beta", "ci", "n_points"} <= set(family_fit)
    for name in ("isoflop.png", "frontier.png", "optimal_sizes.png", "residuals.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| alpha-family |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("family,params,loss\nx,1,2\n", "missing column(s) tokens"),
        ("family,params,tokens,loss\nx,1e6,1e9,2.0\nx,-5,1e9,2.0\n",
         "line 3: column params: expected a positive number, got '-5'"),
        ("family,params,tokens,loss\nx,1e6,0,2.0\n", "line 2: column tokens: expected a positive number, got '0'"),
        ("family,params,tokens,loss\nx,1e6,1e9,abc\n", "line 2: column loss: expected a positive number, got 'abc'"),
        ("family,params,tokens,loss,flops\nx,1e6,1e9,2,-1\n", "line 2: column flops"),
        ("family,params,tokens,loss\n", "no rows"),
    ],
)
def test_bad_results_file_is_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "results.csv"
    path.write_text(content)
    with pytest.raises(ScalingFitError, match=None) as err:
        load_results(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_fewer_points_than_parameters_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "results.csv"
    rows = "".join(f"few,{1e6 * (i + 1)},{1e9},{3 - 0.1 * i}\n" for i in range(4))
    path.write_text("family,params,tokens,loss\n" + rows)
    assert sweep_main(["fit", "--results", str(path)]) == 2
    assert "family few: 4 points: the parametric fit has 5 parameters" in capsys.readouterr().err


def test_missing_results_file(tmp_path: Path) -> None:
    with pytest.raises(ScalingFitError, match="results file not found"):
        load_results(tmp_path / "nope.csv")
