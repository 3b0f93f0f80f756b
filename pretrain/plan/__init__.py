"""Memory planning: what a config needs per rank before it is launched (`memory`).
`python -m pretrain.plan` runs `memory.main`."""
