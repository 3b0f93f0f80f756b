"""The SOE scan on the GPU (Triton; also runs under TRITON_INTERPRET=1 on CPU tensors), in chunk form,
split by pass: tiles.py (shared Triton helpers), states.py (each chunk's state contribution), the light
sequence pass (kernels/span.py), output.py (the chunk-parallel outputs), grads.py (the chunk-parallel
gradients), entering.py (the entering-state read of sequence parallelism), launches.py (the launch
records) and function.py (the autograd Function). docs/kernels.md, "SOE scan: the chunked algorithm",
gives the formulas, the program layout and the determinism rules."""
