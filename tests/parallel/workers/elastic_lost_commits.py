"""Elastic worker for commits that vanish, or a foreign folder at a name another user can
guess (argument: the case).

``lost``: the first life commits steps 1 to 5 (rank 0 tells hvdrun of them at a check), every
rank waits for its writes, rank 0 removes the job's commit folders and rank 1 fails; the next
life finds no commit. ``planted``: rank 0 first makes the folder at the name on disk that
older hvdrun runs derived from the job's folder in memory (``/tmp/<its name>``), owned by
another user, as anyone could from the name in /dev/shm; the job then commits steps 1 to 5.
Rank 0 prints ``LIFE restart=R step=S`` at each start and ``DONE step=S`` at the end.
"""
import os
import shutil
import sys
import tempfile

import hvd_trainer as hvd
from hvd_trainer import elastic
from hvd_trainer.elastic import store
from hvd_trainer_launch import protocol

CASE = sys.argv[1]
NOBODY = 65534


def plant() -> None:
    guessed = os.path.join(tempfile.gettempdir(),
                           os.path.basename(os.environ[protocol.ELASTIC_DIR_VARIABLE]))
    os.mkdir(guessed, 0o700)
    os.chown(guessed, NOBODY, NOBODY)
    print(f"PLANTED {guessed}", flush=True)


@elastic.run
def train(state):
    restart = int(os.environ[protocol.RESTART_VARIABLE])
    if hvd.rank() == 0:
        print(f"LIFE restart={restart} step={state.step}", flush=True)
    if CASE == "planted" and hvd.rank() == 0 and restart == 0:
        plant()
    hvd.barrier()
    for state.step in range(state.step + 1, 6):
        state.commit()
    if CASE == "lost" and restart == 0:
        state.check_host_updates()  # rank 0 tells hvdrun the newest commit it has written
        store.writer.wait()
        hvd.barrier()
        if hvd.rank() == 0:
            for name in ("HVD_ELASTIC_DIR", "HVD_ELASTIC_DISK_DIR"):  # in memory, on disk
                shutil.rmtree(os.environ.get(name, "/nonexistent"), ignore_errors=True)
        hvd.barrier()
        if hvd.rank() == 1:
            raise elastic.HorovodInternalError("rank 1 fails after the commits were removed "
                                               "(simulated)")
        hvd.barrier()
    if hvd.rank() == 0:
        print(f"DONE step={state.step}", flush=True)


train(elastic.ObjectState(step=0))
