"""Run a worker's cases and report each as one JSON record (read by tests/parallel/runner.py).

A worker calls ``run_cases({"name": function, ...})`` with a dict literal (the driver reads
the names from the worker's source, so each case is its own pytest result). Every case runs,
in order (only those named on the command line, if any), and each rank prints one line
``#case {"case": ..., "rank": ..., "ok": ..., "failures": [...]}`` for it: the failures the
case appended to the worker's ``failures`` list, or the exception it raised. A rank whose
cases did not all pass exits 1 after the last.
"""
import json
import sys
import traceback
from typing import Callable, Dict, List, Optional, Sequence

MARK = "#case "


def report(name: str, rank: int, failures: List[str]) -> None:
    """Print one case's record."""
    print(MARK + json.dumps({"case": name, "rank": rank, "ok": not failures,
                             "failures": failures}), flush=True)


def run_cases(cases: Dict[str, Callable[[], None]], failures: Optional[List[str]] = None,
              rank: Optional[int] = None, selected: Optional[Sequence[str]] = None) -> None:
    """Run ``cases`` and report each (see the module docstring); ``failures`` is the list the
    cases append their findings to, ``rank`` this process's (default: the job's rank),
    ``selected`` the cases to run (default: those named on the command line, else all)."""
    if rank is None:
        import hvd_trainer
        rank = hvd_trainer.rank()
    failures = [] if failures is None else failures
    failed = False
    for name in (sys.argv[1:] if selected is None else selected) or cases:
        start = len(failures)
        try:
            cases[name]()
        except Exception:  # noqa: BLE001 - reported as this case's failure
            failures.append(traceback.format_exc())
        found = failures[start:]
        failed = failed or bool(found)
        report(name, rank, found)
    sys.stdout.flush()
    if failed:
        sys.exit(1)
