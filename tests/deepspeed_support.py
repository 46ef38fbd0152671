"""What the DeepSpeed comparison tests share: the fixtures folder and the real DeepSpeed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"


def deepspeed_or_skip():
    """The installed DeepSpeed on its CPU accelerator, or a skip."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken accelerator set-up
        pytest.skip(f"DeepSpeed is not usable here: {type(err).__name__}: {err}")
    return deepspeed
