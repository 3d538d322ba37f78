"""Run several case workers, one after another, in this one process: ``case_chain.py a.py b.py``.

Starting ranks that import a framework costs seconds; workers that need the same framework
and environment can share one job (runner.case_job with a tuple of scripts). Each worker runs
as its own ``__main__`` with all its cases; a worker whose cases failed does not stop the next.
The chain exits 1 when any worker did not exit 0.
"""
import runpy
import sys

failed = False
for script in sys.argv[1:]:
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        failed = failed or end.code not in (None, 0)
sys.exit(1 if failed else 0)
