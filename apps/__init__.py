"""User-facing applications behind the ``pipekernel`` command (``train``, ``schedule``).

Not imported by ``import pipekernel``: they need the optional ``train`` extra
(``tqdm``, ``matplotlib``), which the core never requires.
"""
