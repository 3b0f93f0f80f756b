"""A run's identity: what a start does with the run directory it finds (`directory`: resume, refuse,
start over, nothing left to do), what may change on resume (`resume_rules`) and the weights a new run
starts from (`init_from`)."""
