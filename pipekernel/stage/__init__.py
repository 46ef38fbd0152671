"""One stage's runtime: the layers it builds, the instruction handlers, split backward, skips, loss, device moves."""
