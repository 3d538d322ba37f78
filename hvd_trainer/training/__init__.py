"""Training: a set of gradients reduced step by step (the reducer, its array front end and
step protocol), the autotuner, collective checkpoints."""
