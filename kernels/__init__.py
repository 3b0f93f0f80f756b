"""Scans for recurrent-memory language models: the SOE scan (VORT) and the phasor scan (PMNet).

Each scan has a sequential reference, a chunked PyTorch path (the CPU default) and Triton kernels (the
CUDA default); see docs/kernels.md.
"""

from kernels.phasor import phasor_scan
from kernels.soe import soe_scan

__all__ = ["phasor_scan", "soe_scan"]
