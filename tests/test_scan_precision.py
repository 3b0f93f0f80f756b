"""The scans' operand dtypes under bf16 (docs/kernels.md, "Precision") and the precision benchmark."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kernels
from model import build_model
from model.config import ModelConfig, PMNetConfig, VortConfig

SIZES = {"vocab_size": 32, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 256}
VORT = ModelConfig(
    kind="vort",
    **SIZES,
    vort=VortConfig(n_features=8, n_banks=4, soe_horizon=256, chunk_size=8, probe_rank=4, probe_classes=16),
)
PMNET = ModelConfig(
    kind="pmnet",
    **SIZES,
    pmnet=PMNetConfig(window=4, memory_every=1, branching=2, depth=2, memory_dim=4, segment_len=8),
)


pytestmark = pytest.mark.usefixtures("one_thread")


def spied(monkeypatch: pytest.MonkeyPatch, name: str) -> list[dict[str, torch.dtype]]:
    """Replace kernels.<name> by a wrapper that records the dtype of every tensor argument by name."""
    real, calls = getattr(kernels, name), []
    names = {"soe_scan": ("q", "k", "v", "coef", "log_lam"), "phasor_scan": ("delta", "slots")}[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen = dict(zip(names, args)) | kwargs
        calls.append(
            {k: t.dtype for k, t in seen.items() if isinstance(t, torch.Tensor)}
            | {f"{k}.{i}": t.dtype for k, v in seen.items() if isinstance(v, tuple) for i, t in enumerate(v)}
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, name, wrapper)
    return calls


@pytest.mark.parametrize("precision", [torch.bfloat16, torch.float32])
def test_a_vort_model_hands_the_scan_operands_in_its_dtype_and_decays_in_fp32(
    monkeypatch: pytest.MonkeyPatch, precision: torch.dtype
) -> None:
    calls = spied(monkeypatch, "soe_scan")
    torch.manual_seed(0)
    model = build_model(VORT).to(precision)
    ids = torch.randint(0, 32, (2, 24))
    state = model.init_state(2)  # a carried state: fp32, as the scans keep it
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:], state)
    loss.backward()
    assert len(calls) == VORT.n_layers
    for call in calls:
        assert {call[n] for n in ("q", "k", "v", "coef")} == {precision}, call
        assert call["log_lam"] == call["initial_state.0"] == call["initial_state.1"] == torch.float32, call
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_a_pmnet_model_hands_the_phasor_scan_fp32_increments_under_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 increments drift by a large part of a radian over long sequences (benchmarks.scan_precision's
    phase table), so PMNet keeps them fp32 whatever the run dtype."""
    calls = spied(monkeypatch, "phasor_scan")
    torch.manual_seed(0)
    model = build_model(PMNET).bfloat16()
    assert model.blocks[0].memory.write.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 32, (2, 24))
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert calls and all(c["delta"] == c["initial_state"] == torch.float32 for c in calls), calls


def test_the_precision_table_shows_bf16_rounding_and_fp32_accumulation() -> None:
    from benchmarks import scan_precision

    result = scan_precision.main(["table", "--T", "200", "--decay-T", "96"])
    rows = {r["operands"]: r for r in result["soe"] if r["path"] == "cpu"}
    for name in scan_precision.SOE_NAMES:
        assert rows["float32"][name] < 1e-5, name
    for name in ("o", "z", "dq", "dk", "dv", "dcoef"):  # returned in bf16: its rounding, 2^-9 relative at most
        assert 1e-4 < rows["bfloat16"][name] < 2e-3, name
    assert rows["bfloat16"]["dlog_lam"] < 1e-5  # fp32, as the decays are passed
    walks = {r["operands"]: r for r in result["soe"] if r["path"] == "triton_emulated"}
    assert max(walks["float32"][name] for name in ("o", "z", "dq", "dv")) < 1e-6
    for name in ("o", "z", "dq", "dv"):  # the bf16 walk rounds inside (states read, scores) and then at the store
        assert 1e-5 < walks["bfloat16"][f"{name}_before_store"] < walks["bfloat16"][name] < 5e-3, name
    (decay,) = result["soe_decay"]  # fp32 gradients against float64, fast trainable decays
    assert decay["T"] == 96 and all(0 < decay[n] < 1e-4 for n in scan_precision.SOE_NAMES[2:])
    assert decay["dlog_lam_worst"] >= decay["dlog_lam"]
    (phase,) = result["phasor"]
    assert phase["float32_max_rad"] < 1e-5 < 1e-2 < phase["bfloat16_max_rad"]
    for kind in ("", "rotating_"):  # the kernels' tf32 split keeps fp32-level phases, as their IEEE dots do
        assert 0 < phase[f"{kind}triton_tf32_split_max_rad"] < 1e-4 and phase[f"{kind}triton_ieee_max_rad"] < 1e-4


def test_the_tf32_split_is_exact_and_the_tensor_core_model_rounds_toward_zero() -> None:
    """benchmarks.scan_precision's emulation of the phasor kernels' products: the three pieces of fp32
    values are tf32 (low 13 bits zero) and sum to them exactly; the modelled tensor core truncates where
    the FMA chain rounds to nearest."""
    from benchmarks.scan_precision import select_sum, tensor_core_sum, tf32_pieces

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10
    pieces = tf32_pieces(x)
    assert all(torch.all(p.view(torch.int32) & 0x1FFF == 0) for p in pieces)
    assert torch.equal(sum(p.double() for p in pieces), x.double())
    acc, rows = torch.ones(1), torch.full((1, 1), 0.75 * 2.0**-23)  # 1 + 3/4 ulp
    assert tensor_core_sum(acc, rows).item() == 1.0 and select_sum(acc, rows, split=False).item() == 1 + 2.0**-23


def test_rounded_scan_operands_are_what_a_bf16_model_hands_the_scan() -> None:
    from benchmarks.scan_precision import bf16_scan_operands

    gen = torch.Generator().manual_seed(0)
    q, k = torch.rand(2, 1, 40, 1, 4, generator=gen)
    v, coef = torch.randn(1, 40, 1, 4, generator=gen), torch.rand(1, 40, 1, 3, generator=gen)
    log_lam = -torch.rand(1, 3, generator=gen)
    real = kernels.soe_scan
    with bf16_scan_operands():
        o, z, _ = kernels.soe_scan(q, k, v, coef, log_lam)
    assert kernels.soe_scan is real
    low, low_z, _ = kernels.soe_scan(*(x.bfloat16() for x in (q, k, v, coef)), log_lam)
    assert o.dtype == torch.float32 and torch.equal(o, low.float()) and torch.equal(z, low_z.float())


def test_the_training_summary_pairs_modes_by_seed() -> None:
    from benchmarks.scan_precision import summarise

    curves = {
        "fp32": {"1": [4.0, 3.0, 2.0, 1.0], "2": [4.0, 3.0, 2.0, 1.2]},
        "bf16_scan_operands": {"1": [4.0, 3.1, 2.0, 1.1], "2": [4.0, 3.0, 2.0, 1.2]},
    }
    summary = summarise(curves, 4)
    assert summary["tail_steps"] == 1
    assert summary["paired_difference"] == pytest.approx({"1": 0.1, "2": 0.0})
    assert summary["seed_std_reference"] == pytest.approx(0.2 / 2**0.5)
    assert summary["largest_stepwise_difference"] == pytest.approx({"1": 0.1, "2": 0.0})


def test_the_soe_kernel_emulation_matches_the_triton_kernels_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks.soe_emulation in fp32 (its bf16 rounding points are then no-ops) against the Triton
    kernels run by the interpreter, in spans of several chunks with a short last span and chunk (120
    tokens: 3 spans of 3 chunks, the last 1.5). o, z, dq, dv, dk and dcoef agree to fp32 round-off (1e-6
    relative; a term, a decay or a span-border state missed is off by far more), and are as close to the
    float64 run; with bf16 operands the emulation rounds (before the store: above 1e-5) but stays within
    1e-2 of it."""
    import benchmarks.soe_emulation as emulation
    import kernels.soe.gpu.launches as launches
    from benchmarks.scan_precision import soe_inputs
    from benchmarks.soe_emulation import (
        emulate_coef_grads,
        emulate_forward,
        emulate_key_grads,
        emulate_query_grads,
        emulate_value_grads,
    )

    # spans of 3 chunks (the fewest giving 12 programs of the smallest walks, 4 column blocks of the
    # interpreter's A100 tiles, at batch 1 and one head), in the kernels and the emulation alike
    monkeypatch.setattr(launches, "MIN_PROGRAMS", 12)
    monkeypatch.setattr(launches, "whole_forward_chunks", lambda span, _chunk, _n_chunks: span)
    monkeypatch.setattr(emulation, "CAPABILITY", 80)
    assert launches.walk_span(1, 120, 1, 18, 32, 32, 16, 80) == 3
    inputs, seeds = soe_inputs(120)
    inputs[:3] = [x[..., :32] for x in inputs[:3]]  # F = D = 32: the interpreter's time goes with the blocks
    seeds[0] = seeds[0][..., :32]
    exact = [x.clone().requires_grad_() for x in inputs]
    exact_o, exact_z, _ = kernels.soe_scan(*exact, backend="torch")
    torch.autograd.backward([exact_o, exact_z], seeds)
    leaves = [x.float().requires_grad_() for x in inputs]
    o, z, _ = kernels.soe_scan(*leaves, backend="triton")
    torch.autograd.backward([o, z], [x.float() for x in seeds])
    q, k, v, coef = (x.detach()[0, :, 0] for x in leaves[:4])
    log_lam, d_out, d_z = leaves[4].detach()[0], seeds[0][0, :, 0].float(), seeds[1][0, :, 0].float()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    exact_dv = exact[2].grad[0, :, 0]
    for dtype in (torch.float32, torch.bfloat16):
        got = (
            *emulate_forward(q, k, v, coef, log_lam, dtype),
            emulate_query_grads(k, v, coef, log_lam, d_out, d_z, dtype),
            emulate_value_grads(q, k, coef, log_lam, d_out, dtype),
            emulate_key_grads(q, v, coef, log_lam, d_out, d_z, dtype),
            emulate_coef_grads(q, k, v, coef, log_lam, d_out, d_z, dtype),
        )
        errors = [rel(a, e[0, :, 0]) for a, e in zip(got[:2], (exact_o, exact_z))]
        errors += [rel(got[2], exact[0].grad[0, :, 0]), rel(got[3], exact_dv), rel(got[4], exact[1].grad[0, :, 0]),
                   rel(got[5], exact[3].grad[0, :, 0])]
        if dtype == torch.float32:
            kernels_out = (o.detach()[0, :, 0], z.detach()[0, :, 0], leaves[0].grad[0, :, 0], leaves[2].grad[0, :, 0],
                           leaves[1].grad[0, :, 0], leaves[3].grad[0, :, 0])  # fmt: skip
            against_kernels = [rel(a, b) for a, b in zip(got, kernels_out)]
            assert max(against_kernels) < 1e-6, against_kernels
            assert max(errors) < 1e-6, errors
        else:
            assert all(1e-5 < e < 1e-2 for e in errors), errors
