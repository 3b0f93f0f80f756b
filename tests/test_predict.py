"""The GPU performance model (benchmarks/predict, issue 54): instruction counts read from the SASS of
kernels compiled here, loop trips from the TTGIR, occupancy, fla's launches captured from fla's own code,
and the command line. Compiling runs in a fresh process (tests/predict_worker.py; see
tests/test_kernels_compile.py for why)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@functools.lru_cache(maxsize=1)
def facts() -> dict:
    done = _run(str(ROOT / "tests" / "predict_worker.py"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case,m", [("sm90 BM64", 64), ("sm80 BM64", 64), ("sm90 BM16", 16)])
def test_tensor_flops_counted_from_sass_times_loop_trips(case: str, m: int) -> None:
    """A loop of n products [m, 32] @ [32, 64] per program: the SASS's tensor instructions times the
    loop's trips (an argument) give exactly 2 m 64 32 n FLOPs, for n = 3 and 12."""
    for n in (3, 12):
        got = facts()[f"dot {case} n{n}"]
        assert got["trips"] == [n]
        assert got["flops"] == 2 * m * 64 * 32 * n


def test_wgmma_on_sm90_mma_sync_elsewhere() -> None:
    """A 64-row product runs as wgmma on an H100; 16 rows, or an A100, run mma.sync."""
    assert facts()["dot sm90 BM64 n3"]["wgmma"] and not facts()["dot sm90 BM64 n3"]["hmma"]
    assert facts()["dot sm80 BM64 n3"]["hmma"] and not facts()["dot sm80 BM64 n3"]["wgmma"]
    assert facts()["dot sm90 BM16 n3"]["hmma"]


def test_spills_are_read_and_priced() -> None:
    """Under a register cap that cannot hold the accumulator, ptxas spills to the stack frame: the model
    reads those bytes as spills and counts the local loads and stores (none without the cap)."""
    capped, free = facts()["dot sm80 capped"], facts()["dot sm80 BM64 n12"]
    assert capped["registers"] <= 32 and capped["spills"] > 0 and capped["local"] > 0
    assert free["spills"] == 0 and free["local"] == 0


def test_occupancy_from_registers_shared_and_warps() -> None:
    """Programs per SM: the fewest that registers (per warp in units of 256 of 65,536), shared memory
    (228 KB, 1 KB reserved per block) and warps (64) allow."""
    for got, warps in ((facts()["dot sm90 BM64 n3"], 4), (facts()["dot sm90 BM16 n3"], 1)):
        regs = -(-got["registers"] * 32 // 256) * 256
        expected = min(65_536 // (regs * warps), 228 * 1024 // (got["shared"] + 1024), 64 // warps, 32)
        assert got["occupancy"] == expected


def test_inner_loop_bound_by_the_outer_variable() -> None:
    """An inner loop of i iterations inside one of n: the TTGIR's bounds give n and n (n - 1) / 2
    iterations exactly; in the SASS, LLVM unrolled the inner loop (a long main loop and a short
    remainder loop after it, inside the outer one), and the main loop runs the inner total over its
    unroll factor (a power of two) times."""
    for n in (20, 40):
        got = facts()[f"triangle n{n}"]
        assert got["nest"] == [n, n * (n - 1) / 2]
        (outer, main, rest) = got["loops"]
        assert outer[0] < main[0] < main[1] < rest[0] < rest[1] <= outer[1]
        assert got["trips"][0] == n
        unroll = got["nest"][1] / got["trips"][1]
        assert unroll in (2, 4, 8)


def test_hbm_bytes_are_the_tensors_the_kernel_touches() -> None:
    """A, B and C once each: A grows with n, B and C do not."""
    n3, n12 = facts()["dot sm90 BM64 n3"]["hbm_bytes"], facts()["dot sm90 BM64 n12"]["hbm_bytes"]
    a_row = 8 * 64 * 32 * 2
    assert n12 - n3 == pytest.approx(9 * a_row)
    assert n3 == 3 * a_row + 32 * 64 * 2 + 8 * 64 * 64 * 4


def test_hbm_bytes_of_a_launch_over_part_of_its_tensors() -> None:
    """Two programs over tensors sized for eight (as one phase of a long sequence is launched): HBM bytes
    are what the loads and stores request, below the whole tensors, and at least the parts the two
    programs touch (their rows of A and C, and B)."""
    got = facts()["dot sm90 part"]
    touched = 2 * (3 * 64 * 32 * 2 + 64 * 64 * 4) + 32 * 64 * 2
    assert got["hbm_bytes"] == got["l2_bytes"] < got["tensor_bytes"]
    assert got["hbm_bytes"] >= touched


@pytest.mark.slow
def test_fla_op_predicted_from_its_own_launches() -> None:
    """`python -m benchmarks.predict fla:retention` captures fla's launches (autotuned ones as
    alternatives) and prints forward and forward + backward times; the backward adds time, and a
    longer sequence costs more. Slow: fla autotunes over ~100 configurations, each compiled."""
    pytest.importorskip("fla")
    out = {}
    for t in (2048, 16384):
        done = _run("-m", "benchmarks.predict", "fla:retention", "--shape", f"1,{t},8,64", "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        out[t] = json.loads(done.stdout)
        assert set(out[t]) == {"fwd_ms", "fwdbwd_ms"}
        assert 0 < out[t]["fwd_ms"] < out[t]["fwdbwd_ms"]
    assert out[16384]["fwdbwd_ms"] > out[2048]["fwdbwd_ms"]


def test_bad_shape_is_refused() -> None:
    done = _run("-m", "benchmarks.predict", "fla:retention", "--shape", "1,2048,2")
    assert done.returncode == 2 and "B,T,H,D" in done.stderr


def test_measure_needs_cuda(tmp_path: Path) -> None:
    """--measure builds the measured step and stops, with a clear error, where it needs the device; the
    step it would time runs on CPU (the tiny VORT config, torch scan backend)."""
    import torch

    from benchmarks.predict.measure import require_cuda, training_step
    from model.config import load_model_config

    cfg = load_model_config(ROOT / "configs" / "model" / "vort-tiny.yaml")
    step = training_step(cfg, 1, 64, True, torch.device("cpu"))
    step()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            require_cuda()


@pytest.mark.slow
def test_step_prediction_and_measure_refusal_on_cpu() -> None:
    """`step` prints the issue's keys for a tiny VORT (its scans a share of the step, fla's retention on
    the same work beside); with --measure it says how long the measurement would take by the model,
    then stops with exit 1 and a clear error where it needs CUDA."""
    done = _run("-m", "benchmarks.predict", "step", "--config", "vort-tiny", "--tokens", "1024", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert {"scan_ms", "step_ms", "scan_share", "mfu", "fla_retention_ms"} <= set(out)
    assert 0 < out["scan_ms"] < out["step_ms"] and 0 < out["scan_share"] < 1 and 0 < out["mfu"] < 1
    import torch

    if not torch.cuda.is_available():
        done = _run("-m", "benchmarks.predict", "step", "--config", "vort-tiny", "--tokens", "1024", "--measure")
        assert done.returncode != 0
        assert "by the model's own estimate" in done.stderr and "needs a CUDA device" in done.stderr


@pytest.mark.slow
def test_launch_shapes_are_searched_and_the_best_spills_nothing(tmp_path: Path) -> None:
    """`python -m benchmarks.predict.shapes` compiles every chunk launch of a step under each candidate
    shape and names, per launch, the fastest one that spills nothing, and the shipped one among them.
    Slow: each launch is compiled some thirty times (the first run; then from the cache)."""
    out = tmp_path / "shapes.json"
    done = _run("-m", "benchmarks.predict.shapes", "--config", "vort-tiny", "--tokens", "1024", "--json", str(out),
                timeout=1800)  # some 230 compiles: 11 minutes on 2 cores
    assert done.returncode == 0, done.stderr[-3000:]
    launches = json.loads(out.read_text())["launches"]
    from benchmarks.predict.shapes import CHUNK_KERNELS

    # every chunk kernel, dq and the outputs too, whose config strings (constants, warps, stages) can be equal
    assert {x["launch"] for x in launches} == set(CHUNK_KERNELS)
    for x in launches:
        assert x["best"]["spills"] == 0 and len(x["rows"]) > 10
        assert x["best"]["ms"] == min(r["ms"] for r in x["rows"] if r["spills"] == 0)
        assert x["shipped"] in x["rows"]
