"""Checkpoints: the names of a step directory's files (`layout`), manifests and where checkpoints live
(`manifest`), RNG states (`rng`), the checkpointer that saves, prunes and restores (`checkpointer`),
each engine's payload (`torch_format`, `dcp_format`, `deepspeed_format`), and consolidation of any
engine's checkpoint into one model (`consolidate`)."""
