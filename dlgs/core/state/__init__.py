"""State: checkpoints, the agreements after them, and cross-rank consistency checks."""
