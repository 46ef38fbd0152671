"""``pipekernel.hf``: pipeline any Hugging Face decoder-only causal LM (optional extra ``[hf]``).

Imported only when used; the core never imports it."""
