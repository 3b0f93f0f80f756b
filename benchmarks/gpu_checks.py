"""The device checks of benchmarks.gpu_kernels: correctness at the production tile shapes, per-kernel
timings, the scans' share of a profiled training step, host syncs, bitwise repeatability and one
2-GPU NCCL sequence-parallel step. Each needs a CUDA device; benchmarks/gpu_kernels.py runs them.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.launch_capture import capture_step, meta_model
from kernels._common import capture_launches
from kernels.features import features_torch, positive_features
from kernels.norm import rms_norm, rms_norm_torch
from kernels.order import order_coefficients, order_coefficients_torch
from kernels.parallel import _SoeStateCorrection
from kernels.swiglu import swiglu, swiglu_torch
from kernels.testing import angle_err, phasor_inputs, phasor_run, rel_err, resets, soe_inputs, soe_run
from model import build_model
from model.blocks import rotary_tables
from model.config import ModelConfig

PRODUCTION = {"heads": 12, "terms": 18, "feat": 64, "width": 64}  # vort-125m's scan tiles
TOLERANCES = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (3e-2, 6e-2)}  # (outputs, gradients), relative


def _rounded(inputs: dict[str, torch.Tensor], dtype: torch.dtype, keys: tuple[str, ...] = ()) -> dict:
    """The float64 inputs (those named in ``keys``, or all floating ones) rounded to ``dtype`` and back:
    the reference then sees what the kernels see."""
    return {k: v.to(dtype).double() if v.is_floating_point() and (not keys or k in keys) else v
            for k, v in inputs.items()}


def _entering(inputs: dict[str, torch.Tensor], fn: Callable, dtype: torch.dtype, device: str) -> tuple[list, dict]:
    """Outputs (o, z) of an entering-state read and the gradients of a fixed random linear loss."""
    leaves = {k: v.detach().to(device, dtype if k == "q" else torch.float64 if dtype == torch.float64
                                else torch.float32).requires_grad_() for k, v in inputs.items()}
    outs = fn(leaves["q"], leaves["log_lam"].detach(), leaves["g_in"], leaves["b_in"])
    gen = torch.Generator().manual_seed(0)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum() for o in outs)
    loss.backward()
    return [o.detach().cpu() for o in outs], {k: v.grad.cpu() for k, v in leaves.items() if v.grad is not None}


def check_production(
    device: str = "cuda",
    seq_len: int = 2048,
    tiles: dict[str, int] = PRODUCTION,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> list[dict]:
    """Each scan, the entering-state read, the fused feature map, RMS norm, SwiGLU gate and order coefficients at
    the production tiles (12 heads, 18 terms, 64-wide features and values, rows of heads x values, 256 classes and
    8 banks; PMNet's 4 levels of a 4-ary tree, 64 wide), with document starts and initial states, in fp32 and
    bf16, against float64 on the same rounded inputs (the SOE scan's chunked float64 path, which the tests hold
    to the sequential reference; the phasor scan's sequential reference; the entering read's float64 torch
    form; the fused ops' composite forms). ``tiles`` and ``dtypes`` shrink it for the interpreter tests."""
    from kernels.soe.triton import SoeEnteringTriton

    h, s, f, d = (tiles[k] for k in ("heads", "terms", "feat", "width"))
    reset = resets(seq_len, [[0, seq_len // 3, seq_len * 3 // 4], [seq_len // 2 + 1]])
    soe = soe_inputs(2, seq_len, h, f, d, s, True, seed=1) | {"reset": reset}
    ph, n_slots = phasor_inputs(2, seq_len, 4, d, 4, True, seed=1)
    ph["reset"] = reset
    gen = torch.Generator().manual_seed(2)
    entering = {"q": soe["q"], "log_lam": soe["log_lam"], "g_in": torch.randn(2, h, s, f, d, generator=gen,
                dtype=torch.float64), "b_in": torch.randn(2, h, s, f, generator=gen, dtype=torch.float64)}
    features = {"x": torch.randn(2, seq_len, h, d, generator=gen, dtype=torch.float64),
                "weight": torch.randn(h, f, d, generator=gen, dtype=torch.float64)}
    cos, sin = rotary_tables(torch.arange(seq_len), d, 10_000.0)  # the feature map's, fp32 weight and tables
    features_args = (features["weight"].float().double(), 1.4, cos.double(), sin.double())
    features_on_device = (features["weight"].float().to(device), 1.4, cos.to(device), sin.to(device))
    norm = [torch.randn(2, seq_len, h * d, generator=gen, dtype=torch.float64),
            1.0 + 0.2 * torch.randn(h * d, generator=gen, dtype=torch.float64)]
    gate_up = [3.0 * torch.randn(2, seq_len, 2 * h * d, generator=gen, dtype=torch.float64)]
    order = [2.0 * torch.randn(2, seq_len, 256, generator=gen, dtype=torch.float64),
             torch.rand(2, seq_len, generator=gen, dtype=torch.float64),
             torch.linspace(-2.0, 2.0, h, dtype=torch.float64), torch.full((h,), 2.0, dtype=torch.float64),
             torch.full((h,), 2.0, dtype=torch.float64)]
    order_tables = (torch.linspace(0.1, 1.0, 8, dtype=torch.float64),
                    torch.randn(8, s, generator=gen, dtype=torch.float64))
    order_on_device = tuple(t.float().to(device) for t in order_tables)
    rows = []
    for dtype in dtypes:
        fwd_tol, grad_tol = TOLERANCES[dtype]
        ref_in = _rounded(soe, dtype)
        outs, grads = soe_run(soe, "triton", dtype=dtype, device=device)
        ref, ref_grads = soe_run(ref_in, "torch", dtype=torch.float64)  # chunked float64
        rows.append(_row("soe", dtype, [rel_err(a.cpu(), b) for a, b in zip(outs, ref)],
                         [rel_err(grads[n].cpu(), ref_grads[n]) for n in grads], fwd_tol, grad_tol))
        outs, grads = phasor_run(ph, n_slots, "triton", dtype=dtype, device=device)
        ref, ref_grads = phasor_run(_rounded(ph, dtype), n_slots, "reference", dtype=torch.float64)
        fwd = [angle_err(a.cpu(), b) / (2 * torch.pi) for a, b in zip(outs, ref)]
        rows.append(_row("phasor", dtype, fwd, [rel_err(grads[n].cpu(), ref_grads[n]) for n in grads],
                         fwd_tol, grad_tol))
        outs, grads = _entering(entering, SoeEnteringTriton.apply, dtype, device)
        ref, ref_grads = _entering(_rounded(entering, dtype, ("q",)), lambda *x: _SoeStateCorrection.apply(*x, 64),
                                   torch.float64, "cpu")
        rows.append(_row("soe_entering", dtype, [rel_err(a, b) for a, b in zip(outs, ref)],
                         [rel_err(grads[n], ref_grads[n]) for n in grads], fwd_tol, grad_tol))
        rows.append(_fused_row("features", lambda x: positive_features(x, *features_on_device, "triton"),
                               lambda x: features_torch(x, *features_args), [features["x"]], dtype, device, fwd_tol,
                               grad_tol))
        rows.append(_fused_row("rms_norm", lambda x, w: rms_norm(x, w, 1e-5, "triton"),
                               lambda x, w: rms_norm_torch(x, w, 1e-5), norm, dtype, device, fwd_tol, grad_tol))
        rows.append(_fused_row("swiglu", lambda x: swiglu(x, "triton"), swiglu_torch, gate_up, dtype, device,
                               fwd_tol, grad_tol))
        rows.append(_fused_row("order", lambda *a: order_coefficients(*a, *order_on_device, 0.1, "triton")[0],
                               lambda *a: order_coefficients_torch(*a, *order_tables, 0.1)[0], order, dtype, device,
                               fwd_tol, grad_tol))
    return rows


def _fused_row(case: str, fused: Callable, composite: Callable, inputs: list[torch.Tensor], dtype: torch.dtype,
               device: str, fwd_tol: float, grad_tol: float) -> dict:
    """A fused op (on ``device``) against its composite form in float64 on the same inputs rounded to ``dtype``:
    the output and every input's gradient of a fixed random linear loss."""
    rounded = [t.to(dtype) for t in inputs]
    got_in = [t.to(device).clone().requires_grad_() for t in rounded]
    got = fused(*got_in)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (got.double() * g.to(device)).sum().backward()
    want_in = [t.double().requires_grad_() for t in rounded]
    want = composite(*want_in)
    (want * g).sum().backward()
    return _row(case, dtype, [rel_err(got.detach().cpu(), want.detach())],
                [rel_err(a.grad.cpu(), b.grad) for a, b in zip(got_in, want_in)], fwd_tol, grad_tol)


def _row(case: str, dtype: torch.dtype, fwd: list[float], grad: list[float], fwd_tol: float, grad_tol: float) -> dict:
    worst_fwd, worst_grad = max(fwd), max(grad)
    return {"case": case, "dtype": str(dtype).removeprefix("torch."), "fwd_err": worst_fwd, "grad_err": worst_grad,
            "passed": worst_fwd <= fwd_tol and worst_grad <= grad_tol}


def _kernel_names(run: Callable[[], None]) -> set[str]:
    """The Triton kernels ``run`` launches, by function name (captured, not run)."""
    with capture_launches(90) as found:
        run()
    return {launch.kernel.__name__ for launch, _args in found}


def profile_kernels(run: Callable[[], None]) -> dict[str, float]:
    """Milliseconds of device time per kernel name over one call of ``run`` (after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.self_device_time_total > 0:
            times[evt.key] = times.get(evt.key, 0.0) + evt.self_device_time_total / 1e3
    return times


def _scan_call(cfg: ModelConfig, seq_len: int, dtype: torch.dtype, dev: str) -> Callable[[], None]:
    """One forward and backward of one layer's scan of ``cfg`` (its declared sizes, batch 1) on ``dev``."""
    from kernels import phasor_scan, soe_scan
    from model import family

    scan = family(cfg.kind).scan_shape(cfg)
    gen = torch.Generator().manual_seed(0)
    if scan.kernel == "soe":
        h, s, f, d, chunk = scan.sizes
        x = soe_inputs(1, seq_len, h, f, d, s, False, seed=0)
        x = {k: v.to(dev, torch.float32 if k == "log_lam" else dtype).requires_grad_(k != "log_lam")
             for k, v in x.items()}

        def run() -> None:
            o, z, _ = soe_scan(x["q"], x["k"], x["v"], x["coef"], x["log_lam"], chunk_size=chunk, backend="triton")
            (o.float().sum() + z.float().sum()).backward()

        return run
    levels, width, n_slots = scan.sizes
    delta = torch.randn(1, seq_len, levels, width, generator=gen).to(dev, dtype).requires_grad_()
    base = [sum(4**i for i in range(lvl)) for lvl in range(levels)]
    slots = torch.stack([b + torch.randint(0, 4**lvl, (1, seq_len), generator=gen) for lvl, b in enumerate(base)], -1)
    slots = slots.to(dev)

    def run() -> None:
        read, _ = phasor_scan(delta, slots, n_slots, backend="triton")
        read.float().sum().backward()

    return run


def scan_kernel_times(cfg: ModelConfig, seq_len: int, dtype: torch.dtype, device: str = "cuda") -> dict[str, float]:
    """Per Triton kernel, milliseconds of one forward and backward of one layer's scan of ``cfg`` at
    batch 1 and ``seq_len`` tokens on inputs of ``dtype`` (the kernels: those a meta-device capture of
    the same call launches)."""
    names = _kernel_names(_scan_call(cfg, seq_len, dtype, "meta"))
    return {k: v for k, v in profile_kernels(_scan_call(cfg, seq_len, dtype, device)).items() if k in names}


def _training_step(model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss, _ = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss.detach()

    return step


def _bf16_model(cfg: ModelConfig, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(cfg).to(device, torch.bfloat16)


def step_report(name: str, cfg: ModelConfig, seq_len: int, device: str = "cuda") -> dict:
    """One forward and backward of ``cfg`` in bf16 at batch 1 and ``seq_len`` tokens: the scans' share
    of its kernel time (torch profiler), the host syncs it makes (torch.cuda.set_sync_debug_mode), and
    whether a second run from the same weights and tokens gives bitwise the same loss and gradients."""
    scan_names = {launch.kernel.__name__ for launch, _ in capture_step(meta_model(cfg), 1, seq_len, 90)}
    model = _bf16_model(cfg, device)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
    step = _training_step(model, tokens)
    times = profile_kernels(step)
    total = sum(times.values())
    scans = sum(v for k, v in times.items() if k in scan_names)
    torch.cuda.synchronize()
    syncs: dict[str, int] = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{Path(w.filename).name}:{w.lineno}"
            syncs[where] = syncs.get(where, 0) + 1
    first = (step(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    second = (step(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    differing = [n for n in first[1] if not torch.equal(first[1][n], second[1][n])]
    return {"config": name, "T": seq_len, "kernel_ms": total, "scan_ms": scans,
            "scan_share": scans / total if total else float("nan"), "host_syncs": sum(syncs.values()),
            "sync_sites": syncs, "loss_bitwise_equal": bool(torch.equal(first[0], second[0])),
            "grads_differing": len(differing), "grads": len(first[1]), "first_differing": differing[:5]}


def _sp_worker(rank: int, port: int, cfg: ModelConfig, seq_len: int, out: str) -> None:
    import torch.distributed as dist

    from model import SequenceParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        device = f"cuda:{rank}"
        model = _bf16_model(cfg, device)
        tokens = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
        tokens = tokens.to(device)
        piece = seq_len // 2
        lo, hi = rank * piece, (rank + 1) * piece
        sp = SequenceParallel(group=dist.group.WORLD, rank=rank, size=2, offset=lo)
        total, count, _ = model.summed_loss(tokens[:, lo:hi], tokens[:, lo + 1 : hi + 1], sequence_parallel=sp)
        total.backward()
        summed = torch.stack([total.detach().float(), count.float()])
        dist.all_reduce(summed)
        if rank == 0:
            whole = copy.deepcopy(model)
            whole.zero_grad(set_to_none=True)
            single, _ = whole.loss(tokens[:, :-1], tokens[:, 1:])
            loss = (summed[0] / summed[1]).item()
            Path(out).write_text(json.dumps({"loss_sp": loss, "loss_single": single.item(),
                                             "rel_diff": abs(loss - single.item()) / abs(single.item())}))
    finally:
        dist.destroy_process_group()


def nccl_sequence_parallel(cfg: ModelConfig, seq_len: int) -> dict:
    """One bf16 forward and backward of ``cfg`` split over two GPUs by sequence parallelism over NCCL,
    its loss beside the one-GPU loss of the whole sequence; {"skipped": why} with fewer than 2 GPUs."""
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s): the NCCL step needs 2"}
    import torch.multiprocessing as mp

    from tests.launchers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "sp.json")
        mp.spawn(_sp_worker, args=(free_port(), cfg, seq_len, out), nprocs=2)
        return json.loads(Path(out).read_text())
