"""Layer 1: the instruction loop (a dispatch table and the before/after hooks). Knows nothing of models."""
