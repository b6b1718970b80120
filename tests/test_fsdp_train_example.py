"""examples/fsdp_train.py runs under torchrun on 2 CPU processes (small sizes) and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_torchrun_two_processes() -> None:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
        *("examples/fsdp_train.py", "--samples", "200", "--epochs", "3", "--max-tokens", "512"),
        *("--width", "16", "--layers", "2", "--heads", "2", "--mean-length", "16"),
    ]
    # the checkout under test first (the script's own folder comes first otherwise)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONWARNINGS": "error", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    full, held = map(
        int, re.findall(r"parameters: (\d+) in all, (\d+) held by rank 0", done.stdout)[0]
    )
    assert held * 2 == full, done.stdout  # every parameter sharded over the 2 ranks
    epochs = re.findall(
        r"epoch (\d): loss ([\d.]+) accuracy ([\d.]+) \((\d+) steps per rank, 2 ranks\)",
        done.stdout,
    )
    assert [int(e[0]) for e in epochs] == [0, 1, 2], done.stdout
    losses = [float(e[1]) for e in epochs]
    assert losses[0] > losses[1] > losses[2], losses
    assert float(epochs[-1][2]) > 0.7
