"""Time of one cuBLAS GEMM on a GPU, from its shape: a tile-and-wave model with three constants fitted on
published H100 measurements of torch.matmul / cuBLAS.

The model. cuBLAS computes C [m, n] in output tiles of 128x128, 128x256 or 256x128, and 128x64 or
64x128 for narrow products (NVIDIA, "Matrix Multiplication Background User's Guide", sections "Typical
Tile Dimensions in cuBLAS" and "Dimension Quantization Effects": tile and wave quantisation). Each tile
runs on one SM at EFFICIENCY x that SM's share of the dtype's dense peak. Tiles go out in waves of one
per SM; the last wave counts whole.
When the tiles do not fill the SMs and k is long, cuBLAS splits k (split-K): s partial products, whose
fp32 partial tiles are written and read back once. The operands and the result cross HBM once at
MEMORY_EFFICIENCY x its bandwidth, and the GEMM takes the longer of its compute and its traffic, plus
FIXED_S per call (launch, pipeline fill and epilogue of the last wave; the measurements of small
GEMMs hold the timing loop's own per-call cost too, so FIXED_S is an upper estimate of a step's gaps).
The model picks the tiling and split it predicts fastest, as cuBLAS's heuristics aim to. fp32 operands
(TF32 off, torch's default) run on the CUDA cores at the fp32 peak with the same tiles.

The measurements (CALIBRATION, H100 SXM 80 GB): each is reproduced within TOLERANCE
(tests/test_predict_ops.py); `fit()` returns the constants below from them (scipy's Nelder-Mead from nine starts on the
largest absolute log error, ties broken by the summed squares): the largest error is 19.9%. A per-tile
prologue term (k steps of fill) was tried and fitted to zero.
- Stas Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable
  Matmul FLOPS comparison table" (github.com/stas00/ml-engineering): H100 SXM bf16 794.5 TFLOP/s at
  2048x2048x13312 (torch 2.7.0+cu126) and, in an earlier version of the table, 792.1 at 6144x17920x2816
  (CUDA 12.1).
- zzc0721/torch-performance-test-data, issue 79 (github.com/zzc0721/torch-performance-test-data/issues/79,
  2025-10, "NVIDIA H100 80GB HBM3", torch 2.7.0+cu128, torch.matmul of square matrices): bf16 176.62,
  676.59, 788.72, 797.51, 719.72 TFLOP/s at 1024, 2048, 4096, 8192, 10240; fp32 49.58, 51.88, 51.81 at 2048, 4096, 8192.
- triton-lang/triton issue 2339 (2023-09, H100, the cuBLAS column of Triton's matmul tutorial, fp16):
  M = 2048 and N = K = 512, 1024, 2048, 4096, 8192: 102.6, 243.1, 515.2, 613.7, 721.6 TFLOP/s.
- vllm-project/vllm pull request 49363 (2026-07, H100, `benchmark_fp8_gemm.py`, the torch-bf16 column):
  K = 5376, N = 12288 at M = 128: 352.6; N = 43008 at M = 128 and 256: 364.7 and 593.3 TFLOP/s (these
  are HBM-bound: the weight matrix is read once at a few hundred FLOPs per byte at most).
The two sources at 2048^3 disagree by 31% (515 in 2023, 677 in 2025); TOLERANCE holds both.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from benchmarks.predict.gpu import Gpu

EFFICIENCY = 0.854
"""Fraction of the dtype's per-SM peak a tile's main loop runs at (fitted)."""
FIXED_S = 9.49e-6
"""Seconds per GEMM call besides its tiles and traffic (fitted)."""
MEMORY_EFFICIENCY = 0.900
"""Fraction of the HBM bandwidth a GEMM's operand and result traffic moves at (fitted)."""

TILES = ((128, 128), (128, 256), (256, 128), (128, 64), (64, 128))
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
MIN_SPLIT_K = 256
"""Shortest k piece a split-K GEMM gives each split."""
TOLERANCE = 0.21
"""Largest relative error of a prediction against any CALIBRATION measurement."""

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class Measurement(NamedTuple):
    """One published GEMM time on an H100 SXM: C [m, n] = A [m, k] B [k, n] in ``dtype``."""

    m: int
    n: int
    k: int
    dtype: str
    tflops: float
    source: str


_MAMF, _ZZC = "ml-engineering MAMF table", "zzc0721/torch-performance-test-data#79"
_TRITON, _VLLM = "triton-lang/triton#2339 (cuBLAS column)", "vllm-project/vllm#49363 (torch-bf16)"
CALIBRATION = (
    Measurement(2048, 2048, 13312, "bf16", 794.5, _MAMF),
    Measurement(6144, 17920, 2816, "bf16", 792.1, _MAMF),
    Measurement(1024, 1024, 1024, "bf16", 176.62, _ZZC),
    Measurement(2048, 2048, 2048, "bf16", 676.59, _ZZC),
    Measurement(4096, 4096, 4096, "bf16", 788.72, _ZZC),
    Measurement(8192, 8192, 8192, "bf16", 797.51, _ZZC),
    Measurement(10240, 10240, 10240, "bf16", 719.72, _ZZC),
    Measurement(2048, 2048, 2048, "fp32", 49.58, _ZZC),
    Measurement(4096, 4096, 4096, "fp32", 51.88, _ZZC),
    Measurement(8192, 8192, 8192, "fp32", 51.81, _ZZC),
    Measurement(2048, 512, 512, "fp16", 102.6, _TRITON),
    Measurement(2048, 1024, 1024, "fp16", 243.1, _TRITON),
    Measurement(2048, 2048, 2048, "fp16", 515.2, _TRITON),
    Measurement(2048, 4096, 4096, "fp16", 613.7, _TRITON),
    Measurement(2048, 8192, 8192, "fp16", 721.6, _TRITON),
    Measurement(128, 12288, 5376, "bf16", 352.6, _VLLM),
    Measurement(128, 43008, 5376, "bf16", 364.7, _VLLM),
    Measurement(256, 43008, 5376, "bf16", 593.3, _VLLM),
)


class Constants(NamedTuple):
    """The fitted constants of the model."""

    efficiency: float = EFFICIENCY
    fixed_s: float = FIXED_S
    memory_efficiency: float = MEMORY_EFFICIENCY


def peak_flops(dtype: str, gpu: Gpu) -> float:
    """Dense FLOP/s of a GEMM with operands of ``dtype``: the tensor peak for 16-bit types (twice it for
    fp8), the CUDA-core peak for fp32."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"GEMM dtype {dtype!r}; expected one of {sorted(ELEMENT_BYTES)}")
    if dtype == "fp32":
        return gpu.fp32_peak
    return gpu.bf16_peak * (2 if dtype == "fp8" else 1)


def gemm_seconds(
    batch: int, m: int, n: int, k: int, dtype: str, gpu: Gpu, out_bytes: int | None = None,
    constants: Constants | None = None,
) -> float:
    """Predicted seconds of ``batch`` GEMMs C [m, n] = A [m, k] B [k, n] with operands of ``dtype``
    (the result in ``out_bytes`` per element, the operands' size unless given)."""
    constants = constants or Constants()
    if min(batch, m, n, k) <= 0:
        return constants.fixed_s if min(batch, m, n) > 0 else 0.0
    per_sm = peak_flops(dtype, gpu) / gpu.sms * constants.efficiency
    elt = ELEMENT_BYTES[dtype]
    out = elt if out_bytes is None else out_bytes
    operands = batch * ((m * k + k * n) * elt + m * n * out)
    bandwidth = gpu.hbm_bytes_per_s * constants.memory_efficiency
    best = math.inf
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for split in SPLITS:
            piece = math.ceil(k / split)
            if split > 1 and (piece < MIN_SPLIT_K or tiles >= gpu.sms):
                break
            waves = math.ceil(tiles * split / gpu.sms)
            compute = waves * 2 * tm * tn * piece / per_sm
            partials = 2 * split * batch * m * n * 4 if split > 1 else 0
            best = min(best, max(compute, (operands + partials) / bandwidth))
    return best + constants.fixed_s


def gemm_tflops(m: int, n: int, k: int, dtype: str, gpu: Gpu, constants: Constants | None = None) -> float:
    """Predicted TFLOP/s of one GEMM (2 m n k FLOPs over its predicted time)."""
    return 2 * m * n * k / gemm_seconds(1, m, n, k, dtype, gpu, constants=constants) / 1e12


def calibration_errors(gpu: Gpu, constants: Constants | None = None) -> list[float]:
    """Relative error (predicted / measured - 1) of each CALIBRATION measurement."""
    return [gemm_tflops(c.m, c.n, c.k, c.dtype, gpu, constants) / c.tflops - 1 for c in CALIBRATION]


def fit(gpu: Gpu) -> Constants:
    """The constants that minimise the largest absolute log error over CALIBRATION (ties: the summed
    squared log errors)."""
    from scipy.optimize import minimize

    def loss(x: list[float]) -> float:
        c = Constants(x[0], x[1] * 1e-6, x[2])
        if not (0 < c.efficiency <= 1 and c.fixed_s >= 0 and 0 < c.memory_efficiency <= 1):
            return math.inf
        logs = [math.log1p(e) for e in calibration_errors(gpu, c)]
        return max(map(abs, logs)) + 1e-3 * sum(x * x for x in logs)  # the sum breaks ties

    starts = [[e, f, 0.85] for e in (0.75, 0.85, 0.95) for f in (2.0, 5.0, 10.0)]
    runs = [minimize(loss, x, method="Nelder-Mead", options={"xatol": 1e-5, "fatol": 1e-10}) for x in starts]
    x = min(runs, key=lambda r: r.fun).x
    return Constants(float(x[0]), float(x[1]) * 1e-6, float(x[2]))
