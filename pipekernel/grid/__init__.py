"""The process grid: topology and rank order, data/tensor/expert parallel groups, ZeRO-1,
partitioned activations."""
