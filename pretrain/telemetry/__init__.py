"""What a run reports: the log (`log`), metrics.jsonl, wandb and MFU (`metrics`), elapsed time and time left
(`progress`), and a run's curves drawn from metrics.jsonl (`plot`, `python -m pretrain.telemetry.plot`)."""
