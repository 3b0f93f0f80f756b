"""Scans for recurrent-memory language models: the SOE scan (VORT) and the phasor scan (PMNet), and VORT's
feature map, the RMS norm, the SwiGLU gate and the order router's coefficients as fused ops
(kernels/features/, kernels/norm/, kernels/swiglu/, kernels/order/).

Each scan has a sequential reference, a CPU path (chunked PyTorch for SOE, a numba-compiled loop for
the phasor scan) and Triton kernels (the CUDA default), plus a sequence-parallel form that splits one
sequence across the ranks of a process group; see docs/kernels.md.
"""

from kernels._common import document_numbers, work_dtype
from kernels.features import positive_features
from kernels.norm import rms_norm
from kernels.order import order_coefficients
from kernels.parallel import phasor_scan_sequence_parallel, soe_scan_sequence_parallel
from kernels.phasor import phasor_scan
from kernels.soe import fast_term_count, soe_scan
from kernels.swiglu import swiglu

__all__ = [
    "document_numbers",
    "fast_term_count",
    "order_coefficients",
    "phasor_scan",
    "phasor_scan_sequence_parallel",
    "positive_features",
    "rms_norm",
    "soe_scan",
    "soe_scan_sequence_parallel",
    "swiglu",
    "work_dtype",
]
