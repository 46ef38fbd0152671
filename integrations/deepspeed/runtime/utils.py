"""``deepspeed.runtime.utils``: ``set_random_seed`` and the partition helpers."""
from ..pipe import partition_balanced, partition_uniform, set_random_seed

__all__ = ["set_random_seed", "partition_uniform", "partition_balanced"]
