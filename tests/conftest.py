"""Fixtures shared by several test modules."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: timings and memory peaks on a loaded 2-core
    machine are stable only then. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
