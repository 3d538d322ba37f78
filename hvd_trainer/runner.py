"""``hvd_trainer.run``: horovod.run's API. Call a function on N ranks that hvdrun starts and
return its results in rank order.

The function and its arguments travel to the ranks, and each rank's result (or exception)
back, as files in a private folder (``tempfile.mkdtemp``: mode 0700; owned_folders), each created with
O_EXCL and O_NOFOLLOW, mode 0600, and signed with HMAC-SHA256 under a random secret of this
call that reaches the ranks in their environment; nothing is unpickled before its signature
is verified. The label of each file (its name) is signed with it, so no file can stand in for
another. Pickling is cloudpickle's, as in Horovod, so functions of ``__main__``, lambdas and
closures travel by value. ``python -m hvd_trainer.runner FOLDER`` is the ranks' side.
"""
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from hvd_trainer_launch import owned_folders, signed_files
from hvd_trainer_launch.engine_rank import error_outcome

# The call's secret (hex), for the ranks.
SECRET_VARIABLE = "HVD_RUN_SECRET"
_FUNCTION = "function"
_FOLDER_PREFIX = "hvd_run."  # the calls' folders in the temporary folder (owned_folders)
# Horovod's arguments that hvd_trainer.run refuses, and why.
_ELASTIC = ("elastic jobs run as scripts: hvdrun --min-np N --max-np M python train.py, with "
            "hvd_trainer.elastic.run inside")
_REFUSED = {"min_num_proc": _ELASTIC, "max_num_proc": _ELASTIC, "min_np": _ELASTIC,
            "max_np": _ELASTIC, "slots": _ELASTIC, "reset_limit": _ELASTIC,
            "cooldown_range": _ELASTIC, "host_discovery_script": _ELASTIC,
            "use_gloo": "hvd_trainer runs on MPI only; drop use_gloo"}


def _result_name(rank: int) -> str:
    return f"result.{rank}"


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
    rank raises RuntimeError here naming the rank (the exception itself is its cause when it
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
    import cloudpickle  # only here: the ranks unpickle with pickle

    secret = secrets.token_bytes(32)
    owned_folders.sweep(_FOLDER_PREFIX)
    folder = owned_folders.make(_FOLDER_PREFIX)
    # hvdrun runs under a guard that ends the job and removes the folder if this process
    # dies (hvd_trainer_launch.guard): it watches a pipe whose write end only we hold; a
    # later call's sweep removes it when the guard was killed too.
    watched, watching = os.pipe()
    try:
        signed_files.write_signed(folder, _FUNCTION,
                                  cloudpickle.dumps((func, tuple(args), kwargs or {})), secret)
        command = [sys.executable, "-m", "hvd_trainer_launch.guard", str(watched), folder,
                   *_hvdrun_flags(num_proc, given), "--",
                   executable or sys.executable, "-m", "hvd_trainer.runner", folder]
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
    """The ranks' results in rank order, or RuntimeError naming the ranks that raised or
    left no result."""
    results, raised, missing = [], [], []
    for rank in range(ranks):
        if not os.path.exists(os.path.join(folder, _result_name(rank))):
            missing.append(rank)
            continue
        payload = signed_files.read_signed(folder, _result_name(rank), secret)
        try:
            kind, *value = pickle.loads(payload)
        except Exception as error:  # e.g. a class this process cannot import
            raise RuntimeError(f"hvd_trainer.run: the result of {name} on rank {rank} cannot "
                               f"be unpickled here: {error}") from error
        (results if kind == "ok" else raised).append((rank, *value))
    if raised:
        first, error, text = raised[0]
        ranks_text = (f"rank {first}" if len(raised) == 1 else
                      f"ranks {', '.join(str(r) for r, *_ in raised)} (rank {first}'s below)")
        raise RuntimeError(f"hvd_trainer.run: {name} raised on {ranks_text}:\n{text}") from error
    if missing or code:
        ranks_text = (f"rank{'s' if len(missing) > 1 else ''} "
                      f"{', '.join(map(str, missing))} ended without a result; " if missing else "")
        raise RuntimeError(f"hvd_trainer.run: {ranks_text}hvdrun exited with code {code} "
                           "(the ranks' output above says why)")
    return [value for _, value in results]


def _main(folder: str) -> None:
    """The ranks' side: verify and load the function, call it, write the signed result; an
    exception is written too and then raised, so that hvdrun ends the job."""
    import cloudpickle
    secret = bytes.fromhex(os.environ.pop(SECRET_VARIABLE))  # not for func's own children
    rank = int(os.environ["HOROVOD_RANK"])
    try:
        func, args, kwargs = pickle.loads(signed_files.read_signed(folder, _FUNCTION, secret))
    except FileNotFoundError:
        sys.exit(f"hvd_trainer.run: rank {rank} finds no {os.path.join(folder, _FUNCTION)}: "
                 "every host must see the folder the function travels through; set TMPDIR "
                 "to a folder all hosts share")
    try:
        payload = cloudpickle.dumps(("ok", func(*args, **kwargs)))
    except BaseException as error:
        signed_files.write_signed(folder, _result_name(rank), error_outcome(error), secret)
        raise
    signed_files.write_signed(folder, _result_name(rank), payload, secret)


if __name__ == "__main__":
    _main(sys.argv[1])
