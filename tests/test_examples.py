"""The examples run as documented."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_trains_and_the_loss_falls():
    out = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py"), "--steps", "20"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    first, final = (float(x) for x in last.split()[1:4:2])
    assert "over 20 steps on 2 stages" in last
    assert final < 0.5 * first, last
