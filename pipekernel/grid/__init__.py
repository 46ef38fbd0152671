"""The process grid: topology and rank order, the DeviceMesh (``mesh.py``), FSDP2 timed by
the schedule (``stage_parallel.py``), the parallel options, expert parallel groups,
ZeRO-1."""
