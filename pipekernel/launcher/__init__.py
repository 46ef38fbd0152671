"""Starting ranks: ``launch`` (processes on one host, their tracebacks, interrupts), the
lifeline that ends orphans (``lifeline.py``) and the cluster detection that reads a
launcher's world (``clusters.py``: torchrun, SLURM, MPI, ...)."""
