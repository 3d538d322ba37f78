"""hvdrun for a caller that may die first (``hvd_trainer.run``): ``python -m
hvd_trainer_launch.cli.guard FD FOLDER HVDRUN-ARGUMENTS...`` runs hvdrun in this process and, when the
caller dies, ends the job as on SIGTERM and removes FOLDER (the call's files, which the
caller would have removed after reading the results).

The caller keeps the write end of a pipe whose read end is FD here and never writes to it:
the read sees end-of-file once every copy of the write end is closed, which the kernel does
when the caller dies, even by SIGKILL. A pipe rather than PR_SET_PDEATHSIG, whose signal
comes when the *thread* that started the child ends: a caller that runs
``hvd_trainer.run`` on a thread of its own would see its job killed when that thread ends.
(A process that the caller forks while the job runs inherits the write end, so the job then
ends when the last of them has gone.)
"""
import os
import shutil
import signal
import sys
import threading
from typing import List, Optional


_caller_gone = threading.Event()


def _watch(fd: int) -> None:
    """Block until the caller is gone (end-of-file on ``fd``), then SIGTERM this process:
    hvdrun ends the job as it would for a user's SIGTERM."""
    while os.read(fd, 1):  # the caller never writes; bytes would be no sign of its death
        pass
    _caller_gone.set()
    os.kill(os.getpid(), signal.SIGTERM)


def _leave(signum: int, _frame) -> None:
    """SIGTERM before hvdrun has started the job, or after it ended: leave, cleaning up."""
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    """Run hvdrun with ``argv[2:]`` under the watch of pipe ``argv[0]``; remove folder
    ``argv[1]`` at the end if the caller died. Returns hvdrun's exit code."""
    argv = sys.argv[1:] if argv is None else argv
    fd, folder, arguments = int(argv[0]), argv[1], argv[2:]
    signal.signal(signal.SIGTERM, _leave)
    threading.Thread(target=_watch, args=(fd,), daemon=True, name="hvdrun-caller").start()
    try:
        from hvd_trainer_launch.cli import hvdrun
        return hvdrun.main(arguments)
    finally:
        if _caller_gone.is_set():
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
