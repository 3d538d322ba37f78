"""Call hvd_trainer.run from a plain process (no launcher), as a user's script would.

Run as: run_driver.py <case> <ranks>; the case "horovod" with horovod=True (hvdrun --horovod);
``sleeps`` reports to the folder $RUN_REPORT. The functions live in this script (__main__), so
they travel by value. Prints ``RESULT <repr>`` or ``RAISED <type>: <message> | CAUSE <repr>``,
then which of MXNet and torch this process imported.
"""
import os
import sys
import time

import numpy as np

import hvd_trainer


def times_ten():
    return hvd_trainer.rank() * 10


def summed(offset, scale=1.0):
    """Each rank's allreduce of rank + offset, times scale, and the frameworks it imported."""
    total = hvd_trainer.allreduce(np.array([hvd_trainer.rank() + offset]), op=hvd_trainer.Sum)
    return float(total[0]) * scale, sorted({"mxnet", "torch"} & set(sys.modules))


def raises_on_rank_1():
    if hvd_trainer.rank() == 1:
        raise ValueError("rank 1 found a bad batch")
    return hvd_trainer.rank()


def horovod_root():
    """What ``import horovod`` is on this rank (ModuleNotFoundError without horovod=True)."""
    import horovod
    total = hvd_trainer.allreduce(np.array([hvd_trainer.rank() + 1.0]), op=hvd_trainer.Sum)
    return horovod.__version__, horovod.run is hvd_trainer.run, float(total[0])


def exits_on_rank_1():
    if hvd_trainer.rank() == 1:
        os._exit(3)
    return hvd_trainer.rank()


def sleeps(report):
    """Note this rank's pid and the call's folder (the rank's argument) in ``report``, then
    sleep until killed."""
    path = os.path.join(report, f"rank{hvd_trainer.rank()}")
    with open(path + ".tmp", "w") as out:
        out.write(f"{os.getpid()} {sys.argv[-1]}")
    os.replace(path + ".tmp", path)
    time.sleep(300)


CASES = {"times_ten": (times_ten, (), None), "allreduce": (summed, (1.0,), {"scale": 2.0}),
         "raises": (raises_on_rank_1, (), None), "exits": (exits_on_rank_1, (), None),
         "horovod": (horovod_root, (), None), "no_horovod": (horovod_root, (), None),
         "sleeps": (sleeps, (os.environ.get("RUN_REPORT"),), None)}

if __name__ == "__main__":
    func, args, kwargs = CASES[sys.argv[1]]
    try:
        results = hvd_trainer.run(func, args, kwargs, num_proc=int(sys.argv[2]),
                                  horovod=sys.argv[1] == "horovod")
        print(f"RESULT {results!r}")
    except RuntimeError as error:
        print(f"RAISED {type(error).__name__}: {error} | CAUSE {error.__cause__!r}")
    print(f"IMPORTED {sorted({'mxnet', 'torch'} & set(sys.modules))}", flush=True)
