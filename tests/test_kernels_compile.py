"""The compile gate: every Triton kernel compiled ahead of time for sm_80 and sm_90, without a GPU.

The gate runs as `python -m benchmarks.kernel_compile` in a subprocess: other test modules set
TRITON_INTERPRET=1 at collection, which turns the kernels into interpreted functions that triton
cannot compile, and a fresh process imports them as real JIT functions. One run serves every test here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from benchmarks.kernel_compile import (
    DTYPES,
    MIN_PROGRAMS,
    SHARED_LIMIT,
    TARGETS,
    Row,
    _parse_ptxas,
    shipped_configs,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("gate") / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_compile", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(done.stdout)
    assert out.exists(), done.stderr[-3000:]
    return json.loads(out.read_text())


def test_gate_covers_every_shipped_scan(rows):
    """Each config with a scan has all its kernels on both targets in both dtypes."""
    expected = set()
    for name, cfg in shipped_configs().items():
        if cfg.kind in ("vort", "pl", "exp", "m5"):
            kernels = (
                "soe_fwd_spans",
                "soe_fwd_pass",
                "soe_fwd",
                "soe_bwd_spans",
                "soe_bwd_pass",
                "soe_bwd_forward_order",
                "soe_bwd_reverse_order",
                "soe_entering_fwd",
                "soe_entering_bwd",
            )
        elif cfg.kind == "pmnet" and cfg.pmnet.memory_every:
            kernels = tuple(f"phasor_{k}" for k in ("fwd_spans", "fwd_pass", "fwd", "bwd_spans", "bwd_pass", "bwd"))
        else:
            continue
        expected |= {(name, k, t, d) for k in kernels for t in TARGETS for d in ("fp32", "bf16")}
    assert len(DTYPES) == 2
    found = {(c, r["kernel"], r["target"], r["dtype"]) for r in rows for c in r["configs"]}
    assert expected <= found, sorted(expected - found)


def test_every_kernel_compiles_and_fits_shared_memory(rows):
    for r in rows:
        assert not r["error"], (r["kernel"], r["target"], r["dtype"], r["error"])
        assert r["shared"] <= SHARED_LIMIT[r["target"]], (r["kernel"], r["target"], r["dtype"], r["shared"])
        assert r["registers"] > 0


def test_no_register_spills_in_bf16(rows):
    spilled = [
        (r["kernel"], r["target"], r["constexprs"], r["spills"]) for r in rows if r["dtype"] == "bf16" and r["spills"]
    ]
    assert not spilled


def test_every_kernel_fills_an_h100_at_batch_one(rows):
    """Every kernel of every shipped config, tiny ones included, launches one program per H100 SM or more
    at batch 1 and 65,536 tokens (a row holds the fewest over the configs it serves)."""
    assert MIN_PROGRAMS == 132
    few = [(r["kernel"], r["configs"], r["programs"]) for r in rows if r["programs"] < MIN_PROGRAMS]
    assert not few


LOG = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_k' for 'sm_80'
ptxas info    : Function properties for _k
    24 bytes stack frame, 16 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
"""


def test_ptxas_log_is_parsed():
    assert _parse_ptxas(LOG, "_k") == (255, 24)
    with pytest.raises(ValueError):
        _parse_ptxas(LOG, "_other")


def test_row_failures():
    ok = Row("k", 80, "bf16", ["c"], "", 4, 2, shared=SHARED_LIMIT[80], registers=100)
    assert ok.failures == []
    assert Row("k", 80, "fp32", ["c"], "", 4, 2, shared=1, spills=8).failures == []  # fp32 spills: reported only
    assert len(Row("k", 80, "bf16", ["c"], "", 4, 2, shared=SHARED_LIMIT[80] + 1, spills=8).failures) == 2
    assert Row("k", 90, "bf16", ["c"], "", 4, 2, error="x").failures == ["compile error: x"]
