"""Errors of save_checkpoint / load_checkpoint raise on every rank, and the next collective
works: each case checks the error's class and words on every rank, then an allreduce against
NumPy, then a good save and load of the same trainer.

save_lambda       extra= holds a lambda, which pickle cannot save (ValueError)
load_main_class   extra= holds an instance of a class of this script's __main__, which the
                  reading rank no longer has when it loads (ValueError)
load_dev_zero     /dev/zero: refused by its header, without reading on (ValueError)
load_cut_header   a checkpoint cut inside its header is called truncated (ValueError)
load_missing      a file that does not exist (OSError naming the rank)
Run with a folder as the only argument (the ranks share it; rank 0 writes).
"""
import os
import sys

import mxnet as mx
import numpy as np

import hvd_trainer
import hvd_trainer.mxnet as hvd
from case_runner import run_cases
from trainer_common import make_net

R, N = hvd.rank(), hvd.size()
FOLDER = sys.argv.pop(1)
failures = []


class Epoch:
    """A value of this script's own class (pickled as __main__.Epoch)."""

    def __init__(self, number):
        self.number = number


def trainer():
    net = make_net()
    net.initialize(mx.init.Xavier())
    net(mx.nd.ones((2, 8)))
    return hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})


def raises_everywhere(label, call, cls, words):
    """``call()`` raises ``cls`` with ``words`` in its message on this rank; afterwards the
    next collective works."""
    try:
        call()
        failures.append(f"{label}: no error on rank {R}")
    except cls as e:
        if words not in str(e):
            failures.append(f"{label}: {type(e).__name__} without {words!r}: {e}")
    except Exception as e:  # noqa: BLE001 - reported as this case's failure
        failures.append(f"{label}: {type(e).__name__} instead of {cls.__name__}: {e}")
    got = hvd.allreduce(mx.nd.array(np.full(3, R + 1.0)), op=hvd.Sum, name=f"after {label}")
    if not np.array_equal(got.asnumpy(), np.full(3, N * (N + 1) / 2)):
        failures.append(f"{label}: the next allreduce gave {got.asnumpy()}")


def still_saves(label, t):
    fname = os.path.join(FOLDER, f"{label}.good")
    t.save_checkpoint(fname, extra={"case": label})
    if t.load_checkpoint(fname) != {"case": label}:
        failures.append(f"{label}: a good checkpoint did not round-trip after the error")


def case_save_lambda():
    t = trainer()
    raises_everywhere("save_lambda", lambda: t.save_checkpoint(
        os.path.join(FOLDER, "lambda"), extra={"f": lambda: 0}), ValueError, "cannot be pickled")
    still_saves("save_lambda", t)


def case_load_main_class():
    t = trainer()
    fname = os.path.join(FOLDER, "main_class")
    t.save_checkpoint(fname, extra=Epoch(3))
    kept = sys.modules["__main__"].Epoch
    del sys.modules["__main__"].Epoch  # as a loading script without the class
    try:
        raises_everywhere("load_main_class", lambda: t.load_checkpoint(fname), ValueError,
                          "cannot be unpickled here")
    finally:
        sys.modules["__main__"].Epoch = kept
    still_saves("load_main_class", t)


def case_load_dev_zero():
    t = trainer()
    raises_everywhere("load_dev_zero", lambda: t.load_checkpoint("/dev/zero"), ValueError,
                      "no checkpoint header")
    still_saves("load_dev_zero", t)


def case_load_cut_header():
    t = trainer()
    fname = os.path.join(FOLDER, "cut")
    if R == 0:
        with open(fname, "wb") as f:
            f.write(b"hvd_trainer checkpoint\n")
    hvd_trainer.barrier()
    raises_everywhere("load_cut_header", lambda: t.load_checkpoint(fname), ValueError,
                      "truncated checkpoint")
    still_saves("load_cut_header", t)


def case_load_missing():
    t = trainer()
    raises_everywhere("load_missing", lambda: t.load_checkpoint(os.path.join(FOLDER, "none")),
                      OSError, "rank 0 could not read")
    still_saves("load_missing", t)


run_cases({"save_lambda": case_save_lambda, "load_main_class": case_load_main_class,
           "load_dev_zero": case_load_dev_zero, "load_cut_header": case_load_cut_header,
           "load_missing": case_load_missing}, failures, R)
