"""The benchmark command and the GPU check script: they run and report what they claim (not timed)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_kernels, scan_speed


def test_bench_writes_every_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--T", "32,80", "--H", "1", "--F", "8", "--D", "8", "--S", "2", "--chunk", "16", "--L", "2", "--M", "4"]
    rows = scan_speed.main([*argv, "--repeats", "1", "--threads", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == rows and all(r["matmul_gflops"] > 0 for r in rows)
    assert data["meta"]["matmul_gflops"] == max(r["matmul_gflops"] for r in rows)
    assert [(r["op"], r["mode"], r["T"]) for r in rows] == [
        (op, mode, t) for op in ("soe", "phasor") for mode in ("fwd", "fwdbwd") for t in (32, 80)
    ]
    for r in rows:
        assert r["time_s"] > 0 and r["sdpa_time_s"] > 0
        assert (r["gflops"] is not None) == (r["op"] == "soe")
    assert "x_sdpa" in capsys.readouterr().out


def test_bench_skips_sdpa_above_limit():
    rows = scan_speed.main(["--T", "40", "--ops", "phasor", "--modes", "fwd", "--sdpa-max-T", "16", "--repeats", "1"])
    assert rows[0]["sdpa_time_s"] is None and rows[0]["speedup_vs_sdpa"] is None


def test_bench_rejects_unknown_op():
    with pytest.raises(SystemExit):
        scan_speed.parse_args(["--ops", "retnet"])


def test_soe_flops_are_linear_in_tokens():
    one = scan_speed.soe_flops(1000, 4, 64, 64, 32, 64, backward=True)
    assert scan_speed.soe_flops(4000, 4, 64, 64, 32, 64, backward=True) == pytest.approx(4 * one)
    assert scan_speed.soe_flops(1000, 4, 64, 64, 32, 64, backward=False) < one


def test_gpu_script_parses_arguments():
    args = gpu_kernels.parse_args(["--T", "4096,131072", "--H", "2", "--skip-check"])
    assert args.T == [4096, 131072] and args.H == 2 and args.skip_check
    assert args.train == ["vort-125m", "pmnet-119m"] and args.train_T == 16384 and args.steps == 3
    assert args.check_T == 2048 and args.kernel_T == 65536
    args = gpu_kernels.parse_args(["--train", "tiny-vort,", "--train-T", "64", "--json", "x.json", "--kernel-T", "128"])
    assert args.train == ["tiny-vort"] and args.train_T == 64 and str(args.json) == "x.json" and args.kernel_T == 128
    for bad in (["--steps", "0"], ["--T", "4k"], ["--train", "vort-9b"], ["--check-T", "1"], ["--T", "0"]):
        with pytest.raises(SystemExit):
            gpu_kernels.parse_args(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_script_without_gpu_exits_with_its_status(capsys, tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu_kernels.main(["--T", "4096", "--json", str(out)]) == gpu_kernels.NO_GPU == 2
    assert "no CUDA device: nothing checked" in capsys.readouterr().out
    assert not out.exists()
    with pytest.raises(SystemExit):  # bad arguments are refused before the device is looked for
        gpu_kernels.main(["--steps", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_checks_host_side_parts_run_on_cpu():
    """What the GPU checks do before they touch a device: the kernels a scan call launches (captured on
    meta), the rounding the reference sees, and the NCCL step's skip with fewer than 2 GPUs."""
    from benchmarks import gpu_checks
    from benchmarks.kernel_compile import shipped_configs

    configs = shipped_configs()
    soe = gpu_checks._kernel_names(gpu_checks._scan_call(configs["vort-tiny"], 256, torch.bfloat16, "meta"))
    phasor = gpu_checks._kernel_names(gpu_checks._scan_call(configs["pmnet-tiny"], 256, torch.float32, "meta"))
    assert len(soe) >= 4 and len(phasor) >= 3 and not soe & phasor - {"_span_pass_kernel"}
    x = {"a": torch.tensor([1 + 2**-10], dtype=torch.float64), "i": torch.tensor([3])}
    rounded = gpu_checks._rounded(x, torch.bfloat16)
    assert rounded["a"].item() == 1.0 and rounded["a"].dtype == torch.float64 and rounded["i"] is x["i"]
    assert "skipped" in gpu_checks.nccl_sequence_parallel(configs["vort-tiny"], 64)


@pytest.mark.parametrize("config", ["tiny-vort", "tiny-pmnet"])
def test_gpu_script_training_steps_run_on_cpu(config):
    """The training-step timing of the GPU script, on the CPU at a tiny shape (no plan prediction)."""
    row = gpu_kernels.train_steps(config, 64, 1, "cpu", peak_tflops=1.0, predict=False)
    assert row["config"] == config and row["T"] == 64
    assert row["tokens_per_s"] == pytest.approx(64 / row["step_s"])
    assert 0 < row["mfu"] < 1  # a CPU is far below 1 TFLOP/s


def test_pmnet_scan_share_reports_the_scan_inside_a_block(tmp_path):
    """The share script finds the phasor scan's autograd events in the block's profile: a share in (0, 1)."""
    from benchmarks import pmnet_scan_share

    out = tmp_path / "share.json"
    rows = pmnet_scan_share.main(["--config", "configs/model/pmnet-tiny.yaml", "--T", "64", "--out", str(out)])
    assert [r["T"] for r in rows] == [64]
    assert 0 < rows[0]["scan_s"] < rows[0]["block_s"] and 0 < rows[0]["scan_share"] < 1
    assert json.loads(out.read_text())["rows"] == rows


def test_roofline_models_the_span_kernels_and_the_walks(capsys, tmp_path):
    from benchmarks import roofline
    from benchmarks.kernel_compile import shipped_configs

    configs = shipped_configs()
    steps = {(c, d): roofline.step_model(c, configs[c], d) for c in ("vort-125m", "pl-125m") for d in roofline.DESIGNS}
    # same heads and blocks, 18 vs 16 SOE terms: the span kernels' per-term programs scale with S; the
    # walks' cross-chunk products with the groups' rows (18 = 16 + 2 terms: no padding)
    vort = {k["kernel"]: k for k in steps[("vort-125m", roofline.SPAN)]["kernels"]}
    pl = {k["kernel"]: k for k in steps[("pl-125m", roofline.SPAN)]["kernels"]}
    for kernel in ("soe_fwd_spans", "soe_fwd", "soe_bwd_reverse_order"):
        assert vort[kernel]["flops_per_token_layer"] / pl[kernel]["flops_per_token_layer"] == pytest.approx(18 / 16)
    # the forward's state walk: per token, head and term one write, [64 features x 64 tokens] @ [64 tokens x
    # 64 values] per 64-token chunk
    heads, feat, width, terms = 12, 64, 64, 18
    built = {k["kernel"]: k for k in steps[("vort-125m", roofline.BUILT)]["kernels"]}
    # (on an H100 the normalisers are added by a product with a [64 tokens x 16] tile of ones)
    assert built["soe_fwd_states"]["flops_per_token_layer"] == pytest.approx(heads * terms * 2 * feat * (width + 16))
    # it reads k, v and the coefficients once (the term programs of a head share them through L2) and
    # writes the state entering every 64-token chunk in bf16 for the outputs, plus a few fp32 span states
    per_token = heads * (2 * (feat + width + terms) + terms * feat * (width + 1) * 2 / 64)
    assert per_token < built["soe_fwd_states"]["bytes_per_token_layer"] < per_token * 1.2
    # once a phase each (four phases at 65,536 tokens), the chunk walk again in the backward for every phase
    # but the last, whose states the forward keeps
    runs = {k["kernel"]: k["runs"] for k in built.values() if not k["kernel"].endswith("torch_sums")}
    phases = runs.pop("soe_bwd_reads") + 1
    assert runs == dict.fromkeys(("soe_fwd_states", "soe_fwd", "soe_bwd_chunk_states", "soe_bwd_chunk_queries",
                                  "soe_bwd_chunk_keys_values", "soe_bwd_chunk_coefs"), phases)
    step = steps[("vort-125m", roofline.BUILT)]
    assert step["io_floor_ms"] < step["flop_floor_ms"] < step["scan_ms"]
    assert steps[("vort-125m", roofline.SPAN)]["io_floor_ms"] is None
    for s in steps.values():
        for k in s["kernels"]:
            rate = roofline.PEAK[k["rate"]]
            seconds = max(k["flops_per_token_layer"] / rate, k["bytes_per_token_layer"] / roofline.PEAK_BYTES)
            assert k["step_ms"] == pytest.approx(seconds * roofline.SEQ_LEN * s["scan_layers"] * 1e3)
        assert s["step_ms"] == pytest.approx(s["scan_ms"] + s["other_ms"])
        assert s["scan_share"] == pytest.approx(s["scan_ms"] / s["step_ms"]) and 0 < s["mfu"] < 1
    assert steps[("vort-125m", roofline.SPAN)]["scan_share"] > steps[("vort-125m", roofline.BUILT)]["scan_share"]
    out = tmp_path / "roofline.json"
    assert roofline.main(["--config", "exp-tiny,pmnet-tiny", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count(f"| pmnet-tiny | {roofline.SPAN} |") == 7 and "| tf32 |" in text
    assert "| exp-tiny | built |" in text and text.count("not met") + text.count("| met |") == 4
    assert [(r["config"], r["design"]) for r in json.loads(out.read_text())] == [
        (c, d) for c in ("exp-tiny", "pmnet-tiny") for d in roofline.DESIGNS
    ]
    with pytest.raises(ValueError, match="no scan"):
        roofline.step_model("transformer-tiny", configs["transformer-tiny"], roofline.BUILT)
    with pytest.raises(ValueError, match="design must be one of"):
        roofline.kernel_rows(configs["vort-tiny"], "fused")
    with pytest.raises(SystemExit):
        roofline.main(["--config", "vort-9b"])


def test_roofline_counts_the_slot_blocks_each_phasor_level_spans():
    """A level costs the slot blocks its slots span: depth 3 (85 slots) is one block of 128 for every
    entry; depth 5 (1,365 slots) puts levels 0-3 in block 0, level 4 (slots 85-340) across blocks 0-2
    and level 5 (341-1,364) across blocks 2-10; with the mixture each level below the root has 4
    entries. Sizes no full tree has are refused."""
    from benchmarks.roofline import phasor_level_blocks

    assert phasor_level_blocks(4, 85, 128) == 4 and phasor_level_blocks(13, 85, 128) == 13
    assert phasor_level_blocks(6, 1365, 128) == 1 + 1 + 1 + 1 + 3 + 9
    assert phasor_level_blocks(21, 1365, 128) == 1 + 4 * (1 + 1 + 1 + 3 + 9)
    assert phasor_level_blocks(21, 1365, 2048) == 21
    with pytest.raises(ValueError, match="no full tree has 86 slots"):
        phasor_level_blocks(4, 86, 128)


@pytest.mark.parametrize("config", ["vort-125m", "pmnet-119m"])
def test_roofline_built_design_counts_every_launch_the_step_makes(config):
    """The built rows are the launches the launch functions make, one row per name, each pointer
    argument given an access mode: a kernel added to or removed from soe_launches / phasor_launches, or
    an argument added to one, fails here until the roofline accounts for it."""
    import dataclasses
    from collections import Counter

    import torch

    from benchmarks import roofline
    from benchmarks.kernel_compile import shipped_configs
    from kernels.phasor.triton import phasor_launches
    from kernels.soe.gpu.launches import soe_launches

    cfg = shipped_configs()[config]
    scan = roofline.family(cfg.kind).scan_shape(cfg)
    if scan.kernel == "soe":  # both backwards: the walks (decays with a gradient) and the chunk-parallel one
        heads, terms, feat, width, chunk = scan.sizes
        made, step = {}, None
        for decay_grad in (True, False):
            step = soe_launches(1, 4096, heads, terms, feat, width, chunk, torch.bfloat16, roofline.CAPABILITY,
                                decay_grad)[1]  # fmt: skip
            made |= step
    else:
        made = step = phasor_launches(1, 4096, *scan.sizes, torch.float32, roofline.CAPABILITY)[1]
    assert set(roofline.ACCESS[scan.kernel]) == set(made)
    for name, launch in made.items():
        assert roofline.ACCESS[scan.kernel][name].keys() == launch.pointers.keys(), name
    rows, layers = roofline.kernel_rows(cfg, roofline.BUILT, 4096)
    kernels = [r["kernel"] for r in rows if not r["kernel"].endswith("_torch_sums")]
    # VORT's decays are buffers; at 4,096 tokens one phase covers the sequence, so the forward keeps its
    # per-chunk states and the backward walks no chunks again ("bwd_reads" is made but not launched)
    assert kernels == [f"{scan.kernel}_{n}" for n in step if n != "bwd_reads"] and layers > 0
    # an argument the accounting does not know is an error, not a silent zero
    launch = made["fwd"]
    with pytest.raises(ValueError, match="ACCESS names"):
        roofline.launch_cost(scan.kernel, "fwd", dataclasses.replace(launch, pointers={"extra": "fp32"}), (), Counter())


def test_doc_boundaries_benchmark_reports_both_rates(capsys):
    from benchmarks import doc_boundaries

    argv = ["--kinds", "vort,pmnet", "--T", "64", "--doc-len", "16", "--d-model", "32", "--repeats", "1"]
    rows = doc_boundaries.main(argv)
    assert [r["kind"] for r in rows] == ["vort", "pmnet"]
    assert all(r["documents"] > 1 and r["tokens_per_s"] > 0 and r["tokens_per_s_reset"] > 0 for r in rows)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows


def test_scan_memory_counts_what_one_call_creates(capsys, tmp_path):
    """The allocation count of one Triton SOE call (meta device, launches captured): the span states do
    not grow with the length, so the bytes per token fall towards the per-token buffers (inputs'
    gradients, the coefficient gradient's shares) as the length grows; the largest buffer is one of them;
    a config without an SOE scan is refused with exit 2."""
    from benchmarks import scan_memory
    from kernels.soe.gpu.footprint import scan_allocations

    out = tmp_path / "memory.json"
    assert scan_memory.main(["--config", "vort-tiny", "--T", "4096,65536", "--json", str(out)]) == 0
    short, long = json.loads(out.read_text())
    assert short["tokens"] == 4096 and long["tokens"] == 65536
    assert long["bytes_per_token_layer"] < short["bytes_per_token_layer"]
    assert long["largest_bytes"] <= long["forward_bytes"] + long["backward_bytes"]
    # per token and head at vort-125m's sizes: dq, dk, dv and the coefficient gradient in bf16 and its
    # eight fp32 feature-block shares at least
    counts = scan_allocations((12, 18, 64, 64, 64), 65536)
    per_token = (counts["forward"] + counts["backward"]) / 65536 / 12
    assert 2 * (64 + 64 + 64 + 18) + 8 * 18 * 4 < per_token < 40e3 / 12
    assert scan_memory.main(["--config", "pmnet-tiny"]) == 2
    assert "no SOE scan" in capsys.readouterr().err
