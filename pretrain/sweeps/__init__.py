"""Scaling sweeps: the sweep file and its cells (`spec`), running them locally or on SLURM (`run`),
collecting their final losses (`results`), and the scaling-law fits (`scaling`) with their plots
(`plots`). `launch/sweep.py` is the command."""
