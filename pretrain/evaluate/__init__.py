"""Evaluation of exported models: long-context bits per byte and synthetic tasks (`text`), comparison
of reports (`compare`), what a VORT memory holds (`memory_probe`), and lm-evaluation-harness tasks
(`lm_eval_tasks/`). `python -m pretrain.evaluate` runs `text.main`."""
