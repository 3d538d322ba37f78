"""The ranks' side of an engine job (hvd_trainer.spark, hvd_trainer.ray):
``python -m hvd_trainer_launch.engine_rank``, started by hvdrun's wrapper under a launcher
proxy that an agent runs.

It loads the function from the folder its agent named (protocol.ENGINE_FOLDER_VARIABLE), once
the signature checks out, tells a Spark driver that it runs (engine_registry), calls it, and
leaves the signed result (or the exception) there for the agent to carry back. An exception is raised after it is written, so that the rank exits
non-zero and hvdrun ends the job naming the rank and its host. HOROVOD_HOSTNAME gets this
host's own name back (engine_agent.hostname's): Open MPI's mpirun was given another for it.
"""
import os
import pickle
import socket
import sys
import traceback

from hvd_trainer_launch import engine_registry, signed_files, protocol


def _outcome_of_error(error: BaseException) -> bytes:
    """The pickled ("error", exception, text); the text alone where the exception does not
    survive pickling (some cannot be rebuilt)."""
    import cloudpickle
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        payload = cloudpickle.dumps(("error", error, text))
        pickle.loads(payload)
        return payload
    except Exception:
        return cloudpickle.dumps(("error", None, text))


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
        signed_files.write_signed(folder, label, _outcome_of_error(error), secret)
        raise
    signed_files.write_signed(folder, label, payload, secret)


if __name__ == "__main__":
    sys.exit(main())
