"""Launch records of the SOE chunk kernels: block sizes per GPU target, grids, argument types.

The autograd Functions (kernels/soe/gpu/function.py) launch exactly these, and the compile gate
(benchmarks/kernel_compile.py) compiles them ahead of time: one description of what runs.
"""

from __future__ import annotations

import torch
import triton

from kernels._common import Launch, triton_type
from kernels.soe.gpu.grads import intra_grads_kernel, read_grads_kernel, write_grads_kernel
from kernels.soe.gpu.output import output_kernel
from kernels.soe.gpu.states import chunk_state_kernel
from kernels.span import span_pass_launch


def precision(dtype: torch.dtype) -> str:
    """tl.dot precision: full IEEE fp32 for fp32 inputs (TF32 would cost ~1e-3 relative error); 16-bit
    operands go to the tensor cores as they are, with fp32 accumulation."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Per target (sm_90 or newer): the largest chunk, then per kernel (largest value block, warps, stages).
# Every kernel of one scan uses the same chunk (the sequence pass steps chunk by chunk). Untuned but
# sized for the shipped shapes (64-wide features and values, chunk 64); the compile gate checks each.
CHUNK_MAX = {False: 64, True: 64}
_TABLE: dict[bool, dict[str, tuple[int, int, int]]] = {
    False: {"states": (64, 8, 2), "fwd": (64, 8, 2), "bwd": (32, 8, 1)},
    True: {"states": (64, 8, 2), "fwd": (64, 8, 2), "bwd": (32, 8, 1)},
}
INTS = ("seq_len", "BH", "H", "S", "F", "DV", "W")


def wide_rows(pointers: dict[str, str]) -> frozenset[str]:
    """The arguments a chunk kernel indexes with 64-bit offsets: every token row (``tiles.token_rows``),
    state slot (``tiles.state_row``) and partial buffer; only the [B, T] document numbers and the
    [H, S] decays keep int32 offsets, and they stay far below 2^31 elements at every supported shape."""
    return frozenset(pointers) - {"docs", "log_lam"}


def chunk_block(chunk_size: int, capability: int) -> int:
    """The chunk the kernels use for a requested ``chunk_size``: a power of two, at least 16 (tl.dot's
    minimum), at most the target's CHUNK_MAX. It changes how work is split, not the result."""
    return min(CHUNK_MAX[capability >= 90], max(16, triton.next_power_of_2(chunk_size)))


def value_block(width: int, largest: int) -> int:
    """A value block: at most ``largest`` and the value width rounded up to a power of two (>= 16)."""
    return min(largest, max(16, triton.next_power_of_2(width)))


def soe_launches(
    batch: int,
    seq_len: int,
    heads: int,
    n_terms: int,
    feat: int,
    width: int,
    chunk_size: int,
    dtype: torch.dtype,
    capability: int,
) -> tuple[int, dict[str, Launch]]:
    """(chunk length, launches) of one scan for q, k, v, coef of ``dtype`` and value width ``width`` on a
    GPU of compute capability ``capability``, in the order they run. Forward: "fwd_states" (each chunk's
    state contribution, chunk parallel), "fwd_pass" (the states entering the chunks, one step per chunk),
    "fwd" (the outputs, chunk parallel). Backward: "fwd_states" and "fwd_pass" again (the entering states
    are recomputed, not saved), then "bwd_states" (each chunk's contribution to the state gradients),
    "bwd_pass" (the gradients of the states entering the chunks, in reverse), "bwd_reads", "bwd_writes"
    and "bwd_intra" (the input gradients of the reads of the entering states, of the writes to the
    leaving ones and of the pairs inside a chunk, chunk parallel). Chunk kernels run one program per
    (chunk x batch x head, value block)."""
    cap = capability >= 90
    bt = chunk_block(chunk_size, capability)
    bf = max(16, triton.next_power_of_2(feat))
    n_chunks = triton.cdiv(seq_len, bt)
    operand = triton_type(dtype)
    state_in = {"coef": operand, "log_lam": "fp32", "docs": "i32", "states": "fp32"}
    forward_in = dict.fromkeys(("q", "k", "v"), operand) | state_in
    made = {
        "fwd_states": (chunk_state_kernel, {"x": operand, "y": operand, "coef": operand, "y_norm": operand}
                       | {"log_lam": "fp32", "docs": "i32", "states": "fp32"}, "states", {"REVERSE": False}),
        "fwd": (output_kernel, forward_in | {"out": "fp32", "z": "fp32"}, "fwd", {}),
        "bwd_states": (chunk_state_kernel, {"x": operand, "y": operand, "coef": operand, "y_norm": "fp32"}
                       | {"log_lam": "fp32", "docs": "i32", "states": "fp32"}, "states", {"REVERSE": True}),
        "bwd_reads": (read_grads_kernel, {"q": operand, "log_lam": "fp32", "docs": "i32", "states": "fp32",
                      "d_out": operand} | dict.fromkeys(("d_z", "dq", "dll"), "fp32"), "bwd", {}),
        "bwd_writes": (write_grads_kernel, dict.fromkeys(("k", "v", "coef"), operand) | {"log_lam": "fp32"}
                       | {"docs": "i32"} | dict.fromkeys(("d_states", "dk", "dv", "dcoef", "dll"), "fp32"), "bwd", {}),
        "bwd_intra": (intra_grads_kernel, dict.fromkeys(("q", "k", "v", "coef"), operand)
                      | {"log_lam": "fp32", "docs": "i32", "d_out": operand}
                      | dict.fromkeys(("d_z", "dq", "dk", "dv", "dcoef", "dll"), "fp32"), "bwd", {}),
    }  # fmt: skip
    launches = {}
    for name, (kernel, pointers, kind, extra) in made.items():
        largest, warps, stages = _TABLE[cap][kind]
        bd = value_block(width, largest)
        ints = INTS[:-1] if name == "bwd_intra" else INTS
        scalars = dict.fromkeys(ints, "i32") | ({"centre": "fp32"} if name in ("bwd_reads", "bwd_writes") else {})
        constexprs = {"BT": bt, "BF": bf, "BD": bd} | extra | {"PRECISION": precision(dtype)}
        grid = (n_chunks * batch * heads, triton.cdiv(width, bd), 1)
        launches[name] = Launch(kernel, pointers, scalars, constexprs, grid, warps, stages, wide=wide_rows(pointers))
    n_state = batch * heads * n_terms * feat * (width + 1)
    launches["fwd_pass"] = span_pass_launch(n_state, reverse=False, decay=True, wrap=False)
    launches["bwd_pass"] = span_pass_launch(n_state, reverse=True, decay=True, wrap=False)
    order = ("fwd_states", "fwd_pass", "fwd", "bwd_states", "bwd_pass", "bwd_reads", "bwd_writes", "bwd_intra")
    return bt, {name: launches[name] for name in order}
