"""The ranks' side of an engine job (hvd_trainer.spark, hvd_trainer.ray):
``python -m hvd_trainer_launch.engine_rank``, started by hvdrun's wrapper under a launcher
proxy that an agent runs.

It loads the function from the folder its agent named (protocol.ENGINE_FOLDER_VARIABLE), once
the signature checks out, tells a Spark driver that it runs (engine_registry), calls it, and
leaves the signed result (or the exception) there for the agent to carry back. An exception is raised after it is written, so that the rank exits
non-zero and hvdrun ends the job naming the rank and its host. HOROVOD_HOSTNAME gets this
host's own name back (engine_agent.hostname's): Open MPI's mpirun was given another for it.

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
import traceback

from hvd_trainer_launch import engine_registry, horovod_shim, signed_files, protocol


def error_outcome(error: BaseException) -> bytes:
    """The pickled ("error", exception, text) of a rank whose function raised ``error``; the
    text alone where the exception does not survive pickling (some cannot be rebuilt). A
    subclass of SystemExit (hvd_trainer's own, from sys.exit in a job) travels as the
    SystemExit that the function's sys.exit call means; the text leaves out the frames that
    say ``__tracebackhide__ = True`` (the convention of pytest's: that sys.exit's)."""
    import cloudpickle
    if isinstance(error, SystemExit) and type(error) is not SystemExit:
        plain = SystemExit(error.code)
        plain.__cause__, plain.__context__ = error.__cause__, error.__context__
        error = plain.with_traceback(error.__traceback__)
    shown = traceback.TracebackException(type(error), error, error.__traceback__)
    hidden = [bool(frame.f_locals.get("__tracebackhide__"))
              for frame, _ in traceback.walk_tb(error.__traceback__)]
    shown.stack = traceback.StackSummary.from_list(
        [entry for entry, hide in zip(shown.stack, hidden) if not hide])
    text = "".join(shown.format())
    try:
        payload = cloudpickle.dumps(("error", error, text))
        pickle.loads(payload)
        return payload
    except Exception:
        return cloudpickle.dumps(("error", None, text))


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


def main() -> None:
    """Run the function of this rank's agent and leave the outcome for it."""
    import cloudpickle
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
    label = protocol.ENGINE_RESULT.format(rank=rank)
    func, args, kwargs = pickle.loads(
        signed_files.read_signed(folder, protocol.ENGINE_FUNCTION, secret))
    registry = os.environ.pop(engine_registry.VARIABLE, None)
    if registry:  # a Spark job's driver: its start ends when every rank runs the function
        engine_registry.report_running(registry, secret, rank)
    try:
        payload = cloudpickle.dumps(("ok", func(*args, **kwargs)))
    except BaseException as error:
        signed_files.write_signed(folder, label, error_outcome(error), secret)
        raise
    signed_files.write_signed(folder, label, payload, secret)


if __name__ == "__main__":
    sys.exit(main())
