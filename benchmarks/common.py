"""Shared plumbing for the benchmarks that compare one process with 2 ranks."""
import json
import os
import platform
import re
import subprocess
import sys
from typing import List


def launch(script: str, ranks: int, args: List[str], threads: int = 1) -> dict:
    """Run ``script --worker ...`` on ``ranks`` fresh processes; return the RESULT rank 0 prints.

    ``ranks`` 1 runs plain python (no launcher, no MPI); more go through hvdrun.
    """
    worker = [sys.executable, os.path.abspath(script), *args]
    cmd = ([sys.executable, "-m", "hvd_trainer_launch.hvdrun", "-np", str(ranks), "--no-prefix"]
           + worker if ranks > 1 else worker)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    found = re.search(r"RESULT (\{.*\})", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return json.loads(found.group(1))


def report(results: dict) -> None:
    """Print the line the parent process parses (rank 0 only, by the caller's choice)."""
    print("RESULT " + json.dumps(results), flush=True)


def cpu_model() -> str:
    """The processor's model name, for the header of a results table."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
