"""Processes and meshes: the process group and its collectives (`process_group`), and the
(data x sequence)-parallel mesh with the sequence-parallel loss (`parallel_dims`)."""
