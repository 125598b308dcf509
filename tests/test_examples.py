"""examples/: each script runs as documented and reports the engine's guarantees held (its exit
status is 0 only when every loss, gradient and budget check inside it passed)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300               # a hang fails the test instead of blocking CI


def run(args: list) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_train_small():
    out = run(["examples/train_small.py", "--steps", "2", "--device", "cpu"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("(identical)") == 2
    assert "budget held on every step: True" in out.stdout


@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available")
def test_fsdp2_torchrun_on_two_cpu_ranks():
    steps = 2
    out = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/fsdp2_torchrun.py", "--steps", str(steps), "--accum", "2"])
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        lines = re.findall(rf"^rank {rank} \| step \d+ \| peak .*$", out.stdout, re.M)
        assert len(lines) == steps, out.stdout
        assert not any(" | out 0 B | " in line for line in lines), "the engine moved nothing"
        assert re.search(rf"^rank {rank}: budget .* held on every step: True; losses and gradient "
                         r"shards identical to the run without the engine: True$", out.stdout,
                         re.M), out.stdout
