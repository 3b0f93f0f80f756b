"""The step model's op capture (benchmarks/predict/ops.py), GEMM curve (gemm.py) and training-step
capture and pricing (step.py), on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from benchmarks.predict import gemm
from benchmarks.predict.gpu import H100
from benchmarks.predict.ops import Op, capture_ops, summarize
from benchmarks.predict.step import ATTENTION_EFFICIENCY, capture_step_ops, price_by_kind, price_ops
from model.config import load_model_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"


def meta(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device="meta", requires_grad=grad)


def named(ops: list[Op], prefix: str) -> list[Op]:
    return [op for op in ops if op.name.startswith(prefix)]


def test_linear_forward_backward_flops_and_bytes():
    B, D_in, D_out, bf = 8, 64, 32, 2
    lin = torch.nn.Linear(D_in, D_out).to(device="meta", dtype=torch.bfloat16)
    x = meta(B, D_in, dtype=torch.bfloat16, grad=True)
    ops = capture_ops(lambda: lin(x).float().sum().backward())
    gemms = [op for op in ops if op.kind == "gemm"]
    assert len(gemms) == 3  # forward, grad input, grad weight
    assert all(op.flops == 2 * B * D_in * D_out for op in gemms)
    assert sorted((g.gemm.m, g.gemm.n, g.gemm.k) for g in gemms) == sorted(
        [(B, D_out, D_in), (B, D_in, D_out), (D_out, D_in, B)])
    forward = named(ops, "aten.addmm")[0]
    assert forward.bytes_read == (B * D_in + D_in * D_out + D_out) * bf
    assert forward.bytes_written == B * D_out * bf
    assert forward.gemm.dtype == "bf16"
    assert summarize(ops)["gemm"]["flops"] == 3 * 2 * B * D_in * D_out


def test_inplace_add_reads_and_writes_its_target():
    a, b = meta(10), meta(10)
    (op,) = capture_ops(lambda: a.add_(b))
    assert (op.kind, op.bytes_read, op.bytes_written) == ("memory", 80, 40)
    (op,) = capture_ops(lambda: a.copy_(b))  # overwritten whole: not read
    assert (op.bytes_read, op.bytes_written) == (40, 40)


def test_fills_shaped_like_a_tensor_read_nothing():
    """new_zeros, zeros_like and full_like take a shape, dtype and device from their input: they write
    their output and read nothing, in eager pricing and under the compile model (which, as nothing reads
    the fill after it, moves no byte for it at all)."""
    from benchmarks.predict.price import fused_memory

    a = meta(1000, 100)
    fills = ((lambda: a.new_zeros(10), 40), (lambda: torch.zeros_like(a), 400_000),
             (lambda: torch.full_like(a, 2.0), 400_000))
    for fill, size in fills:
        (op,) = capture_ops(fill)
        assert (op.kind, op.bytes_read, op.bytes_written) == ("memory", 0, size)
        assert fused_memory([op], [])[0] == 0


def test_view_chain_moves_nothing_and_a_copying_reshape_does():
    a = meta(4, 6)
    ops = capture_ops(lambda: a.view(2, 12).unsqueeze(0).transpose(1, 2)[0, 3:].expand(2, 9, 2))
    assert ops and all(op.kind == "view" and op.bytes == 0 for op in ops)
    ops = capture_ops(lambda: a.t().reshape(24))  # not viewable: a clone
    assert [op.kind for op in ops if op.bytes] == ["memory"]
    assert sum(op.bytes for op in ops) == 2 * 24 * 4


def test_expanded_and_list_inputs_count_their_storage():
    a = meta(1, 10)
    (op,) = [op for op in capture_ops(lambda: a.expand(100, 10).sum()) if op.kind == "memory"]
    assert op.bytes_read == 40  # stride-0 rows read once
    xs, ys = [meta(5) for _ in range(3)], [meta(5) for _ in range(3)]
    (op,) = capture_ops(lambda: torch._foreach_add_(xs, ys))
    assert (op.bytes_read, op.bytes_written) == (6 * 20, 3 * 20)


def test_scatter_writes_only_what_its_source_holds():
    target, rows, values = meta(1000, 100), torch.zeros(10, dtype=torch.long, device="meta"), meta(10)
    cols = torch.zeros(10, dtype=torch.long, device="meta")
    (op,) = capture_ops(lambda: target.index_put_((rows, cols), values))
    assert (op.bytes_read, op.bytes_written) == (2 * 80 + 40, 40)
    (op,) = capture_ops(lambda: target.index_put_((rows, cols), values, accumulate=True))
    assert (op.bytes_read, op.bytes_written) == (2 * 80 + 40 + 40, 40)


def test_checkpointed_block_records_its_forward_twice():
    lin = torch.nn.Linear(16, 16).to("meta")
    x = meta(4, 16, grad=True)

    def step(checkpointed: bool) -> list[Op]:
        def block(t: torch.Tensor) -> torch.Tensor:
            return torch.relu(lin(t))

        def run() -> None:
            y = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
            y.sum().backward()

        return capture_ops(run)

    plain, recomputed = step(False), step(True)
    assert len(named(plain, "aten.addmm")) == 1 and len(named(recomputed, "aten.addmm")) == 2
    assert len(named(recomputed, "aten.relu.")) == 2 * len(named(plain, "aten.relu."))


def test_gemm_curve_reproduces_its_published_table():
    errors = gemm.calibration_errors(H100)
    bad = [(c, f"{e:+.3f}") for c, e in zip(gemm.CALIBRATION, errors) if abs(e) > gemm.TOLERANCE]
    assert not bad, bad
    assert len({c.source for c in gemm.CALIBRATION}) >= 4


def test_gemm_constants_are_the_fit():
    fitted = gemm.fit(H100)
    assert fitted.efficiency == pytest.approx(gemm.EFFICIENCY, rel=0.01)
    assert fitted.fixed_s == pytest.approx(gemm.FIXED_S, rel=0.01)
    assert fitted.memory_efficiency == pytest.approx(gemm.MEMORY_EFFICIENCY, rel=0.01)


def test_gemm_time_follows_peak_waves_and_bandwidth():
    big = gemm.gemm_seconds(1, 8192, 8192, 8192, "bf16", H100)
    fp32 = gemm.gemm_seconds(1, 8192, 8192, 8192, "fp32", H100)
    assert fp32 / big == pytest.approx(H100.bf16_peak / H100.fp32_peak, rel=0.05)
    # 12 x 11 tiles of 128x256 are one wave; a 13th tile row costs at least a quarter wave more
    # (the best tiling is then 128x64: 13 x 44 tiles, 5 waves of quarter tiles against 4)
    whole = gemm.gemm_seconds(1, 128 * 12, 256 * 11, 8192, "bf16", H100)
    assert gemm.gemm_seconds(1, 128 * 13, 256 * 11, 8192, "bf16", H100) > 1.2 * whole
    # a skinny GEMM is bound by reading its weight
    weight = 43008 * 5376 * 2
    assert gemm.gemm_seconds(1, 16, 43008, 5376, "bf16", H100) > weight / H100.hbm_bytes_per_s
    with pytest.raises(ValueError, match="GEMM dtype"):
        gemm.gemm_seconds(1, 8, 8, 8, "int4", H100)


def test_price_ops_rules():
    a, b, c = meta(256, 512, dtype=torch.bfloat16), meta(512, 128, dtype=torch.bfloat16), meta(1000)
    (gemm_op,) = capture_ops(lambda: a @ b)
    (memory_op,) = capture_ops(lambda: c * 2)
    (view_op,) = capture_ops(lambda: c.view(10, 100))
    eff, launch = 0.8, 4e-6
    seconds = price_by_kind([gemm_op, memory_op, view_op], H100, eff, launch)
    assert seconds["gemm"] == gemm.gemm_seconds(1, 256, 128, 512, "bf16", H100)
    assert seconds["memory"] == pytest.approx(8000 / (H100.hbm_bytes_per_s * eff) + launch)
    assert seconds["view"] == 0
    assert price_ops([gemm_op, memory_op, view_op], H100, eff, launch) == pytest.approx(sum(seconds.values()))
    with pytest.raises(ValueError, match="memory_efficiency"):
        price_ops([memory_op], H100, 0.0, launch)


@pytest.mark.parametrize("name", ["vort-tiny", "pmnet-tiny"])
def test_training_step_capture(name):
    cfg = load_model_config(CONFIGS / f"{name}.yaml")
    on = capture_step_ops(cfg, 2, 256, activation_checkpointing=True)
    assert on.launches and on.ops
    names = {op.name.split(".")[1] for op in on.ops}
    assert {"_fused_adamw_", "_foreach_norm", "_foreach_mul_", "_foreach_copy_", "embedding_dense_backward"} <= names
    summary = on.summary()
    assert summary["triton_launches"] == len(on.launches)
    assert 0.9 < summary["gemm_flops_over_expected"] < 1.1  # 6N plus the recompute
    off = capture_step_ops(cfg, 2, 256, activation_checkpointing=False)
    # the recompute adds the blocks' forward GEMMs, at most 2 x block parameters x tokens: less by the
    # blocks' vectors, norms and biases (parameters that run no GEMM) and by each block's last product,
    # whose output no backward needs (non-reentrant checkpointing stops its recompute before it)
    recompute = summary["gemm"]["flops"] / off.summary()["gemm"]["flops"]
    assert 1.1 < recompute <= on.expected_gemm_flops / off.expected_gemm_flops
    def scans(capture) -> list:  # the scans' launches (the fused feature map, kernels/features, is recomputed)
        return [launch for launch in capture.launches if launch.origin == "kernels"]

    assert len(scans(on)) == len(scans(off))  # the recompute takes the scans' outputs the forward kept
    kept = capture_step_ops(cfg, 2, 256, activation_checkpointing="elementwise")  # keeps the matmuls' outputs too
    assert kept.summary()["gemm"]["flops"] == off.summary()["gemm"]["flops"]
    assert kept.expected_gemm_flops == off.expected_gemm_flops
    # AdamW on fp32 masters: reads weight, gradient and two moments, writes weight and moments
    adam = sum(op.bytes for op in on.ops if "_fused_adamw_" in op.name)
    assert adam >= 28 * on.matmul_params


def test_attention_runs_fused_with_its_flops():
    cfg = load_model_config(CONFIGS / "transformer-tiny.yaml")
    B, T = 2, 128
    cap = capture_step_ops(cfg, B, T, activation_checkpointing=True)
    attention = [op for op in cap.ops if op.kind == "attention"]
    head_dim = cfg.d_model // cfg.n_heads
    forward = 2 * B * cfg.n_heads * T * T * 2 * head_dim / 2  # causal
    assert len(attention) == 3 * cfg.n_layers  # forward, recompute, backward
    assert sum(op.flops for op in attention) == pytest.approx(cfg.n_layers * forward * (2 + 2.5))
    seconds = price_by_kind(attention, H100, 0.8, 4e-6)["attention"]
    assert seconds == pytest.approx(sum(op.flops for op in attention) / (H100.bf16_peak * ATTENTION_EFFICIENCY))


def test_fused_memory_reads_inputs_once_and_writes_what_is_read_later() -> None:
    """Under the compile model a pointwise chain before a GEMM reads its input once and writes only the
    tensor the GEMM reads; the intermediates cost nothing. A parameter updated in place is written
    even though nothing reads it after; a new result nothing reads (the unused sum) is not."""
    from benchmarks.predict.price import fused_memory

    x = torch.empty(64, 32, device="meta")
    w = torch.empty(32, 16, device="meta")
    p = torch.empty(1000, device="meta")

    def fn() -> None:
        c = ((x * 2) + 1).exp()
        y = c @ w
        y.sum()
        p.add_(1.0)

    ops = capture_ops(fn)
    moved, kernels = fused_memory(ops, [])
    chain = 64 * 32 * 4 * 2  # x read, c written
    after = 64 * 16 * 4 + 1000 * 4 * 2  # y read by the sum; p read and written
    assert moved == chain + after
    eager = sum(op.bytes for op in ops if op.kind == "memory")
    assert eager > moved
    assert kernels == 3  # the chain; the sum and the in-place add (two output sizes) after the GEMM
