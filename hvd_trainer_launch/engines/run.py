"""``hvd_trainer.run``: horovod.run's API. Call a function on N ranks that hvdrun starts and
return its results in rank order.

The function and its arguments travel to the ranks, and each rank's outcome back, as signed
files (files.signed) in a private folder of this call (files.owned_folders), under a random
secret of this call that reaches the ranks in their environment. Everything else is what the
engines do too (engines.calls, engines.rank.call_function): hvdrun (over ssh, or on this
machine) stands where an engine's agents stand. ``python -m hvd_trainer_launch.engines.run
FOLDER`` is the ranks' side.
"""
import os
import secrets
import shutil
import signal
import subprocess
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import calls
from hvd_trainer_launch.engines.rank import call_function
from hvd_trainer_launch.files import owned_folders, signed

# The call's secret (hex), for the ranks.
SECRET_VARIABLE = "HVD_RUN_SECRET"
_FOLDER_PREFIX = "hvd_run."  # the calls' folders in the temporary folder (owned_folders)
# Horovod's arguments that hvd_trainer.run refuses, and why.
_ELASTIC = ("elastic jobs run as scripts: hvdrun --min-np N --max-np M python train.py, with "
            "hvd_trainer.elastic.run inside")
_REFUSED = {"min_num_proc": _ELASTIC, "max_num_proc": _ELASTIC, "min_np": _ELASTIC,
            "max_np": _ELASTIC, "slots": _ELASTIC, "reset_limit": _ELASTIC,
            "cooldown_range": _ELASTIC, "host_discovery_script": _ELASTIC,
            "use_gloo": "hvd_trainer runs on MPI only; drop use_gloo"}


def _hvdrun_flags(num_proc: int, given: Dict[str, Any]) -> List[str]:
    """hvdrun's flags for horovod.run's arguments (those not None)."""
    flags = ["-np", str(num_proc)]
    for name, flag in (("hosts", "-H"), ("hostfile", "--hostfile"),
                       ("start_timeout", "--start-timeout"), ("ssh_port", "-p"),
                       ("ssh_identity_file", "-i"), ("output_filename", "--output-filename")):
        if given.get(name) is not None:
            flags += [flag, str(given[name])]
    for name, flag in (("disable_cache", "--disable-cache"), ("verbose", "--verbose"),
                       ("use_mpi", "--mpi"), ("horovod", "--horovod")):
        if given.get(name):
            flags.append(flag)
    if given.get("mpi_args"):
        flags.append(f"--mpi-args={given['mpi_args']}")  # '=': the value may start with '-'
    if given.get("network_interfaces"):
        flags += ["--network-interfaces", ",".join(given["network_interfaces"])]
    return flags


def run(func: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None, num_proc: int = 1,
        min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None,
        cooldown_range: Optional[Sequence[float]] = None, hosts: Optional[str] = None,
        hostfile: Optional[str] = None, host_discovery_script: Optional[str] = None,
        start_timeout: Optional[float] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, disable_cache: Optional[bool] = None,
        output_filename: Optional[str] = None, verbose: Optional[bool] = None,
        use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None, network_interface: Optional[str] = None,
        network_interfaces: Optional[Sequence[str]] = None, executable: Optional[str] = None,
        np: Optional[int] = None, min_np: Optional[int] = None,
        max_np: Optional[int] = None, *, horovod: bool = False) -> List[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks started by hvdrun; return the
    results as a list indexed by rank.

    horovod.run's signature. ``hosts``, ``hostfile``, ``start_timeout``, ``ssh_port``,
    ``ssh_identity_file``, ``disable_cache``, ``output_filename``, ``verbose``, ``use_mpi``,
    ``mpi_args`` and ``network_interfaces`` act as hvdrun's flags of those names;
    ``executable`` is the Python that runs ``func`` on the ranks (default: this one). ``np``
    and ``network_interface`` are deprecated spellings, as in Horovod. ``horovod=True`` (ours,
    keyword-only) is ``hvdrun --horovod``: ``func`` may ``import horovod.torch`` and the other
    horovod modules, which are hvd_trainer's on the ranks. The elastic arguments
    and ``use_gloo`` raise ValueError naming the argument. An exception in ``func`` on some
    rank raises EngineError (a RuntimeError) here naming the rank (the exception itself is its cause when it
    could be pickled); so does a rank that ends without a result. It blocks until the job ends.
    """
    given = dict(locals())
    for name, why in _REFUSED.items():
        if given[name] is not None and given[name] is not False:
            raise ValueError(f"hvd_trainer.run: {name}={given[name]!r} is not supported: {why}")
    for old, new in (("np", "num_proc"), ("network_interface", "network_interfaces")):
        if given[old] is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning,
                          stacklevel=2)
    if np is not None:
        num_proc = np
    if network_interface:
        given["network_interfaces"] = network_interface.split(",")
    if hosts is not None and hostfile is not None:
        raise ValueError("hvd_trainer.run: give hosts or hostfile, not both")
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"hvd_trainer.run: num_proc={num_proc!r} must be an int >= 1")
    secret = secrets.token_bytes(32)
    owned_folders.sweep(_FOLDER_PREFIX)
    folder = owned_folders.make(_FOLDER_PREFIX)
    # hvdrun runs under a guard that ends the job and removes the folder if this process
    # dies (hvd_trainer_launch.cli.guard): it watches a pipe whose write end only we hold; a
    # later call's sweep removes it when the guard was killed too.
    watched, watching = os.pipe()
    try:
        signed.write_signed(os.path.join(folder, protocol.ENGINE_FUNCTION), secret,
                            calls.payload(func, args, kwargs))
        command = [sys.executable, "-m", "hvd_trainer_launch.cli.guard", str(watched), folder,
                   *_hvdrun_flags(num_proc, given), "--",
                   executable or sys.executable, "-m", "hvd_trainer_launch.engines.run", folder]
        env = dict(os.environ, **{SECRET_VARIABLE: secret.hex()})
        process = subprocess.Popen(command, env=env, pass_fds=(watched,))
        os.close(watched)
        watched = -1
        try:
            code = process.wait()
        except BaseException:  # Ctrl-C here: hvdrun ends the job, then we go
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            process.wait()
            raise
        return _collect(folder, secret, num_proc, code, getattr(func, "__name__", repr(func)))
    finally:
        for end in (watched, watching):
            if end >= 0:
                os.close(end)
        shutil.rmtree(folder, ignore_errors=True)


def _collect(folder: str, secret: bytes, ranks: int, code: int, name: str) -> List[Any]:
    """The ranks' results in rank order, or EngineError (a RuntimeError) naming the ranks that
    raised or left no result."""
    outcomes = {}
    for rank in range(ranks):
        path = os.path.join(folder, protocol.ENGINE_RESULT.format(rank=rank))
        if os.path.exists(path):
            outcomes[rank] = signed.read_signed(path, secret)
    return calls.gather(outcomes, ranks, f"hvd_trainer.run: {name}", {}, code, [])


def _main(folder: str) -> None:
    """The ranks' side: the function called as every call on N ranks calls it
    (engines.rank.call_function), from the folder the caller named."""
    secret = bytes.fromhex(os.environ.pop(SECRET_VARIABLE))  # not for func's own children
    rank = int(os.environ["HOROVOD_RANK"])
    if not os.path.exists(os.path.join(folder, protocol.ENGINE_FUNCTION)):
        sys.exit(f"hvd_trainer.run: rank {rank} finds no "
                 f"{os.path.join(folder, protocol.ENGINE_FUNCTION)}: every host must see the "
                 "folder the function travels through; set TMPDIR to a folder all hosts share")
    call_function(folder, secret, rank)


if __name__ == "__main__":
    _main(sys.argv[1])
