"""The process grid: topology and rank order, data/tensor parallel groups, ZeRO-1, partitioned activations."""
