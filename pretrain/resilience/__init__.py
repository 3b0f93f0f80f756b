"""What keeps a long run going without a person: the hang watchdog (`watchdog`), the straggler report
(`straggler`) and the loss-spike rule behind the in-process rollback (`spike`)."""
