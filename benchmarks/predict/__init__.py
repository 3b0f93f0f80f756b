"""A performance model of GPU training steps, priced from what runs: the Triton launches as they compile
(instruction mix from the SASS, occupancy, waves, bytes) and every other aten op of the step (GEMMs by a
measured efficiency curve, the rest by bytes). `python -m benchmarks.predict --help`; docs/kernels.md,
"Predicted GPU times"."""
