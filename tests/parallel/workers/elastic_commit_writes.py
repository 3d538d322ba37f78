"""Elastic worker whose first life ends while commit K is being written in the background.

Usage: elastic_commit_writes.py MODE RESULT_FOLDER, MODE one of:
- ``kill``: every rank's write of commit K stops after its first piece (a disk that hangs),
  and rank 1 SIGKILLs itself once its temporary file holds that piece; the others are ended
  by the launcher, mid-write too. No rank has commit K whole.
- ``raise``: rank 1 raises right after commit K returns, while its write (slowed to a piece
  per 0.1 s) goes on; the others' writes of commit K hang. Only rank 1 can complete commit K
  (the rank that ends the job finishes its writes first).
- ``failed-write``: not elastic (HVD_ELASTIC_DIR and HVD_JOB_SECRET are set by the test);
  rank 1's writes fail with EIO and every rank commits until one raises, then prints
  ``RAISED at=I: message``.

Commit k holds ``step=k`` and ``weights = arange(N) + k``. In the second life rank 0 writes
the restored step and weights (``restored.npy``, ``restored.json``) to RESULT_FOLDER, with the
temporary files found in the job's folders after the restore, then the job commits twice
more and ends.
"""
import errno
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import hvd_trainer as hvd
from hvd_trainer import elastic
from hvd_trainer.elastic import store
from hvd_trainer.runtime import files
from hvd_trainer_launch import protocol
from hvd_trainer_launch.files import signed

N = 1 << 20  # float64 weights: 8 MiB, 8 pieces of a write
K = 3
mode, folder = sys.argv[1], sys.argv[2]
life = int(os.environ.get("HVD_ELASTIC_RESTART", "0"))
_write_all = signed.write_all  # every piece of a commit goes through it
hang = threading.Event()  # set: this rank's writes stop after their first piece
never = threading.Event()


def faulty_write_all(fd: int, data) -> None:
    _write_all(fd, data)
    if hang.is_set() and memoryview(data).nbytes >= 1 << 20:  # one piece of the arrays written
        if mode == "raise" and hvd.rank() == 1:
            time.sleep(0.1)  # slow, but it ends
        else:
            never.wait()


def temporary_size() -> int:
    """The size of this rank's temporary file of commit K (0 while there is none)."""
    for name in os.listdir(os.environ["HVD_ELASTIC_DIR"]):
        if name.startswith(f".rank{hvd.rank()}.{K:012d}.commit.") and name.endswith(".tmp"):
            try:
                return os.path.getsize(os.path.join(os.environ["HVD_ELASTIC_DIR"], name))
            except FileNotFoundError:
                pass
    return 0


def commit(state, k: int) -> None:
    state.step = k
    state.weights[:] = np.arange(N) + k
    state.commit()


@elastic.run
def train(state):
    if life == 0:
        for k in range(1, K):
            commit(state, k)
        store.writer.wait()  # commit K - 1 is whole on every rank
        hang.set()
        commit(state, K)
        if mode == "raise" and hvd.rank() == 1:
            raise RuntimeError("rank 1 fails right after commit K (simulated)")
        if hvd.rank() == 1:
            while temporary_size() < (1 << 20):
                time.sleep(0.001)
            whole = 8 * N
            print(f"KILLED with {temporary_size()} of more than {whole} bytes written",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.barrier()  # the ranks wait here until the launcher ends them
        return
    if hvd.rank() == 0:
        left = [name for f in protocol.job_folders(os.environ["HVD_ELASTIC_DIR"],
                                                os.environ.get("HVD_ELASTIC_DISK_DIR"))
                if os.path.isdir(f) for name in os.listdir(f) if name.endswith(".tmp")]
        np.save(os.path.join(folder, "restored.npy"), state.weights)
        with open(os.path.join(folder, "restored.json"), "w") as f:
            json.dump({"step": state.step, "temporaries": left}, f)
    for k in (state.step + 1, state.step + 2):
        commit(state, k)


def failing_writes() -> None:
    if hvd.rank() == 1:
        def refuse(*args, **kwargs):
            raise OSError(errno.EIO, "simulated I/O error")
        files.write_signed = refuse
    state = elastic.ObjectState(step=0, weights=np.zeros(N))
    for k in range(1, 6):
        try:
            commit(state, k)
        except OSError as error:
            print(f"RAISED at={k}: {error}", flush=True)
            return
    print("NOTHING RAISED", flush=True)


if mode == "failed-write":
    hvd.init()
    failing_writes()
else:
    signed.write_all = faulty_write_all
    train(elastic.ObjectState(step=0, weights=np.zeros(N)))
