"""The ranks' side of an engine job (hvd_trainer.spark, hvd_trainer.ray):
``python -m hvd_trainer_launch.engines.rank``, started by hvdrun's wrapper under a launcher
proxy that an agent runs.

It loads the function from the folder its agent named (protocol.ENGINE_FOLDER_VARIABLE), once
the signature checks out, tells a Spark driver that it runs (registry.py), calls it, and
leaves the signed result (or the exception) there for the agent to carry back. An exception is raised after it is written, so that the rank exits
non-zero and hvdrun ends the job naming the rank and its host. HOROVOD_HOSTNAME gets this
host's own name back (agent.hostname's): Open MPI's mpirun was given another for it.

Where ``import horovod`` finds nothing on this rank's own path (this host, this Python), the
rank gets hvd_trainer's horovod shim, which its agent wrote, at the end of its path: a
function written for Horovod (``import horovod.torch as hvd``) runs unchanged, whatever its
driver imported, and an installed Horovod is never shadowed. ``HVD_HOROVOD_SHIM=0`` in the
ranks' environment (the engine's ``env``/``extra_env_vars``) turns it off.
"""
import os
import pickle
import socket
import sys
from typing import Callable, Optional

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import calls, registry
from hvd_trainer_launch.files import signed
from hvd_trainer_launch.offers import LEFT_VARIABLE
from hvd_trainer_launch.rank import horovod_shim


def offer_horovod_shim(folder: str) -> bool:
    """Put the shim in ``folder`` last on this process's path and its children's PYTHONPATH,
    unless ``import horovod`` finds a package already (a real Horovod, or a shim) or
    HVD_HOROVOD_SHIM=0; whether it did."""
    if os.environ.get(horovod_shim.VARIABLE) == "0" or horovod_shim.found() is not None:
        return False
    sys.path.append(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.environ["PYTHONPATH"], folder] if os.environ.get("PYTHONPATH") else [folder])
    return True


def call_function(folder: str, secret: bytes, rank: int,
                  started: Optional[Callable[[], None]] = None) -> None:
    """Load the function from ``folder`` once its signature checks out, say so to
    ``started`` (if any), call it, and leave this rank's signed :class:`calls.Outcome` there;
    an exception is left too and then raised, so that the rank exits non-zero and hvdrun ends
    the job naming it (a rank that an elastic job left out in place says so instead,
    offers.LEFT_VARIABLE). The ranks' side of every call on N ranks (hvd_trainer.run's too)."""
    func, args, kwargs = pickle.loads(
        signed.read_signed(os.path.join(folder, protocol.ENGINE_FUNCTION), secret))
    if started is not None:
        started()
    result = os.path.join(folder, protocol.ENGINE_RESULT.format(rank=rank))
    try:
        outcome = calls.returned(func(*args, **kwargs))
    except BaseException as error:
        # A rank that an elastic job went on without (offers.LEFT_VARIABLE) says so instead.
        left = isinstance(error, SystemExit) and os.environ.get(LEFT_VARIABLE)
        signed.write_signed(result, secret, calls.left_job() if left else calls.raised(error))
        raise
    signed.write_signed(result, secret, outcome)


def main() -> None:
    """Run the function of this rank's agent and leave the outcome for it."""
    folder = os.environ.pop(protocol.ENGINE_FOLDER_VARIABLE)  # not for func's own children
    secret = bytes.fromhex(os.environ.pop(protocol.ENGINE_SECRET_VARIABLE))
    os.environ.pop(protocol.ENGINE_LAUNCH_SECRET_VARIABLE, None)
    if "HOROVOD_HOSTNAME" in os.environ:  # Open MPI's mpirun knew the host by another name
        os.environ["HOROVOD_HOSTNAME"] = socket.gethostname()
    try:  # the agent's working directory (a Spark task's, a Ray actor's), as Horovod's ranks
        os.chdir(os.environ.pop(protocol.ENGINE_WORKDIR_VARIABLE))
    except (KeyError, OSError):
        pass
    offer_horovod_shim(os.path.join(folder, protocol.ENGINE_SHIM_FOLDER))
    rank = int(os.environ["HOROVOD_RANK"])
    commits = os.environ.pop(protocol.ENGINE_COMMITS_VARIABLE, None)
    if commits:  # an elastic job's: the commits live in the agent's folder on this host,
        os.environ[protocol.ELASTIC_DIR_VARIABLE] = commits  # and its events go there too
        os.environ.pop(protocol.ELASTIC_DISK_DIR_VARIABLE, None)
        os.environ[protocol.ENGINE_EVENTS_VARIABLE] = os.path.join(
            folder, protocol.ENGINE_EVENTS.format(rank=rank))
    address = os.environ.pop(registry.VARIABLE, None)
    # A Spark job's driver: its start ends when every rank runs the function.
    started = (lambda: registry.report_running(address, secret, rank)) if address else None
    call_function(folder, secret, rank, started)


if __name__ == "__main__":
    sys.exit(main())
