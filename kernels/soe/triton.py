"""Triton kernels for the SOE scan (the CUDA path; also runs under TRITON_INTERPRET=1 on CPU tensors).

The kernels live in kernels/soe/gpu/, one module per pass; this module keeps the public names.
"""

from __future__ import annotations

from kernels.soe.gpu.entering import SoeEnteringTriton, entering_launches
from kernels.soe.gpu.function import SoeScanTriton
from kernels.soe.gpu.launches import soe_launches

__all__ = ["SoeEnteringTriton", "SoeScanTriton", "entering_launches", "soe_launches"]
