"""Run a worker's cases (those named on the command line, or all) and report its failures."""
import sys
from typing import Callable, Dict, List


def run_cases(cases: Dict[str, Callable[[], None]], failures: List[str], rank: int,
              passed: str) -> None:
    """Run the cases in order; exit 1 listing ``failures`` if any, else print ``passed``."""
    for name in sys.argv[1:] or cases:
        cases[name]()
        print(f"rank {rank} {name}: done", flush=True)
    if failures:
        print(f"rank {rank}:", *failures, sep="\n  ")
        sys.exit(1)
    print(f"rank {rank}: {passed}")
