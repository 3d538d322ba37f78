"""Finding the mpiexec that belongs to mpi4py's MPI library, and speaking its dialect.

MPICH and Intel MPI ship the Hydra process manager; Open MPI ships its own mpirun. They differ in
how the environment reaches the ranks, how hosts are written and whether a node may run more
ranks than it has cores, so the command line is built per flavour.
"""
import functools
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

HYDRA = "hydra"
OPENMPI = "openmpi"
FLAVOUR_NAMES = {HYDRA: "MPICH/Intel MPI (Hydra)", OPENMPI: "Open MPI"}

INSTALL_HINT = (
    "install one with `pip install mpi4py mpich`, or install a system MPI (e.g. "
    "`apt-get install openmpi-bin libopenmpi-dev`) and then `pip install mpi4py`; "
    "or name the launcher with --mpiexec PATH (or HVD_MPIEXEC=PATH)"
)

# Variables that describe an enclosing Open MPI job; mpirun sets its own for the new job.
_OPENMPI_PRIVATE_PREFIXES = ("OMPI_", "PMIX_", "PRTE_")
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_LIBMPI = re.compile(r"/libmpi(ch)?\.so")


class MPIError(Exception):
    """No usable MPI launcher; the message says what is wrong and how to fix it."""


class Launcher(NamedTuple):
    """An mpiexec/mpirun executable and the flavour (HYDRA or OPENMPI) of its arguments."""

    path: str
    flavour: str


def flavour_of(path: str) -> Optional[str]:
    """Tell Hydra from Open MPI by what ``path --version`` prints; None if it is neither."""
    return flavour_in(version_text(path))


def version_text(path: str) -> str:
    """What ``path --version`` prints ('' when it cannot run)."""
    try:
        result = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.decode(errors="replace")


def flavour_in(text: str) -> Optional[str]:
    """The launcher flavour whose ``--version`` prints ``text``; None if it is neither."""
    if "Open MPI" in text or "OpenRTE" in text:
        return OPENMPI
    if "HYDRA" in text or "Intel(R) MPI" in text or "MPICH" in text:
        return HYDRA
    return None


def mpi_library() -> Tuple[Optional[str], List[str]]:
    """Ask mpi4py, without initialising MPI, for its library's version text and libmpi's folders.

    Returns (None, []) when mpi4py or its MPI library cannot be loaded.
    """
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        version = MPI.Get_library_version()
    except Exception:  # ImportError, or a RuntimeError/OSError when libmpi cannot be loaded
        return None, []
    folders: List[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if _LIBMPI.search(path) and os.path.dirname(path) not in folders:
                    folders.append(os.path.dirname(path))
    except OSError:  # not Linux: fall back to the interpreter's and PATH's folders
        pass
    return version, folders


def library_flavour(version: Optional[str]) -> Optional[str]:
    """The launcher flavour that matches an MPI library version text (None if unknown)."""
    if not version:
        return None
    if "Open MPI" in version:
        return OPENMPI
    if any(name in version for name in ("MPICH", "Intel", "MVAPICH")):
        return HYDRA
    return None


def candidate_folders(library_folders: Sequence[str]) -> List[str]:
    """Folders that may hold the launcher: next to libmpi first, then the interpreter's, then PATH."""
    folders = []
    for lib in library_folders:
        folders += [os.path.join(lib, os.pardir, "bin"), os.path.join(lib, os.pardir, os.pardir, "bin"), lib]
    folders += [os.path.join(sys.prefix, "bin"), os.path.dirname(sys.executable)]
    folders += os.environ.get("PATH", "").split(os.pathsep)
    unique = []
    for folder in folders:
        folder = os.path.normpath(folder) if folder else ""
        if folder and folder not in unique:
            unique.append(folder)
    return unique


def find_launcher(requested: Optional[str] = None) -> Launcher:
    """The launcher to use: ``requested`` (or $HVD_MPIEXEC) if given, else the one matching mpi4py's MPI.

    Raises MPIError naming the problem and the fix when there is none.
    """
    requested = requested or os.environ.get("HVD_MPIEXEC")
    if requested:
        path = shutil.which(requested)
        if path is None:
            raise MPIError(f"mpiexec {requested!r} (from --mpiexec or HVD_MPIEXEC) does not exist "
                           "or is not executable; give the full path of an mpiexec or mpirun")
        flavour = flavour_of(path)
        if flavour is None:
            print(f"hvdrun: warning: cannot tell from `{path} --version` whether it is Hydra or "
                  "Open MPI; using Hydra's arguments", file=sys.stderr)
        return Launcher(path, flavour or HYDRA)
    version, library_folders = mpi_library()
    wanted = library_flavour(version)
    others = []
    for folder in candidate_folders(library_folders):
        for name in ("mpiexec", "mpirun"):
            path = os.path.join(folder, name)
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                continue
            flavour = flavour_of(path)
            if flavour is not None and wanted in (None, flavour):
                return Launcher(path, flavour)
            others.append(path)
    if version and others:
        raise MPIError(f"mpi4py uses {version.splitlines()[0].strip()!r} but the launchers found "
                       f"({', '.join(others)}) belong to another MPI; pass the matching one with "
                       "--mpiexec PATH")
    raise MPIError(f"no MPI launcher (mpiexec or mpirun) found; {INSTALL_HINT}")


def slurm_allocation(environ: Mapping[str, str]) -> List[Tuple[str, int]]:
    """The nodes of the Slurm allocation that hvdrun runs in (sbatch, salloc) with their task
    slots, in Slurm's order, from SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE ('2(x3),1'):
    where Hydra and Open MPI place the ranks when given no hosts. [] outside an allocation;
    ValueError for a node list that this does not read."""
    nodelist, tasks = environ.get("SLURM_JOB_NODELIST"), environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks:
        return []
    counts: List[int] = []
    for part in tasks.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not found:
            raise ValueError(f"SLURM_TASKS_PER_NODE={tasks!r}: expected N or N(xM) entries")
        counts += [int(found[1])] * int(found[2] or 1)
    nodes = _expand_nodelist(nodelist)
    if len(nodes) != len(counts):
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names {len(nodes)} nodes but "
                         f"SLURM_TASKS_PER_NODE={tasks!r} {len(counts)}; give the hosts with -H")
    return list(zip(nodes, counts))


def _expand_nodelist(nodelist: str) -> List[str]:
    """Slurm's compressed host list ('node[01-03,07],gpu1') as host names."""
    entries, depth, start = [], 0, 0
    for index, char in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(nodelist[start:index])
            start = index + 1
    names = []
    for entry in entries:
        ranged = re.fullmatch(r"([^\[\]]*)\[([\d,-]+)\]([^\[\]]*)", entry)
        if not ranged:
            if not entry or "[" in entry or "]" in entry:
                raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read {entry!r}; "
                                 "give the hosts with -H")
            names.append(entry)
            continue
        prefix, ranges, suffix = ranged.groups()
        for span in ranges.split(","):
            low, _, high = span.partition("-")
            names += [f"{prefix}{number:0{len(low)}d}{suffix}"
                      for number in range(int(low), int(high or low) + 1)]
    return names


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """Parse ``host:slots,host,...`` (slots default to 1) into (host, slots) pairs."""
    hosts = []
    for entry in spec.split(","):
        host, _, slots = entry.strip().partition(":")
        hosts.append(_host(host, slots or "1", entry))
    return hosts


def read_hostfile(path: str) -> List[Tuple[str, int]]:
    """Read a hostfile with one ``host slots=N`` (Open MPI's form, where ``max_slots=M`` may
    follow: accepted, and not used, since hvdrun starts ranks on slots only), ``host:N``
    (MPICH's) or bare ``host`` a line; # starts a comment. Errors name the file and line."""
    hosts = []
    with open(path, encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, 1):
                entry = line.split("#", 1)[0].strip()
                if not entry:
                    continue
                try:
                    hosts.append(_hostfile_entry(entry))
                except ValueError as e:
                    raise ValueError(f"hostfile {path!r}, line {number}: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"hostfile {path!r} is not a text file (byte {e.start} is not "
                             "UTF-8); give a file of lines 'host slots=N' or 'host:N'") from None
    return hosts


def _hostfile_entry(entry: str) -> Tuple[str, int]:
    """One hostfile line: ``host:N``, or ``host`` with options ``slots=N`` and ``max_slots=M``."""
    host, *options = entry.split()
    if not options and ":" in host:
        host, _, slots = host.partition(":")
        return _host(host, slots or "1", entry)
    given: Dict[str, str] = {}
    for option in options:
        key, equals, value = option.partition("=")
        if not equals or key not in ("slots", "max_slots") or key in given:
            raise ValueError(f"bad host entry {entry!r}: {option!r} is not one of slots=N, "
                             "max_slots=M (each at most once)")
        given[key] = value
    found = _host(host, given.get("slots", "1"), entry)
    most = given.get("max_slots")
    if most is not None and (not most.isdigit() or int(most) < found[1]):
        raise ValueError(f"bad host entry {entry!r}: max_slots must be a whole number no less "
                         "than slots")
    return found


def _host(host: str, slots: str, entry: str) -> Tuple[str, int]:
    """Check one host entry; the error quotes the entry and the expected form."""
    if not host or not slots.isdigit() or int(slots) < 1:
        raise ValueError(f"bad host entry {entry!r}: expected host:slots or 'host slots=N' with N >= 1")
    return host, int(slots)


@functools.lru_cache(maxsize=None)
def _local_names() -> frozenset:
    """localhost, this machine's host names, and the addresses its host name resolves to."""
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return frozenset(names)


def this_machine(name: str) -> bool:
    """Whether ``name`` names the machine hvdrun runs on (a loopback address or a local name)."""
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:  # a name, not an address
        pass
    return name in _local_names()


def placement(flavour: str, hosts: Sequence[Tuple[str, int]], np: int) -> List[Tuple[str, int]]:
    """The nodes the launcher makes of ``hosts`` (host, slots), in order, each with the number
    of ranks it gets when ``np`` ranks fill their slots in order (both launchers map by slot).

    Hydra makes each entry a node of its own, even two that name one machine (``localhost``
    and ``127.0.0.1``); Open MPI makes one node of the entries that name one machine (the
    same name, or this machine under any of its names), with their slots summed, in the place
    of the first. ValueError when ``np`` exceeds the slots, as in horovodrun.
    """
    nodes: List[List] = []
    for host, slots in hosts:
        same = None
        if flavour == OPENMPI:
            same = next((node for node in nodes if node[0] == host
                         or (this_machine(node[0]) and this_machine(host))), None)
        if same is None:
            nodes.append([host, slots])
        else:
            same[1] += slots
    total = sum(slots for _, slots in nodes)
    if np > total:
        raise ValueError(f"-np {np} is more than the {total} slots of the hosts given "
                         f"({','.join(f'{h}:{s}' for h, s in hosts)}); give more slots "
                         "(host:N) or a smaller -np")
    layout = []
    for host, slots in nodes:
        if np > 0:
            layout.append((host, min(slots, np)))
            np -= min(slots, np)
    return layout


def build_command(launcher: Launcher, np: int, hosts: Sequence[Tuple[str, int]],
                  mpi_args: Sequence[str], program: Sequence[str],
                  environ: Mapping[str, str],
                  forward: Optional[Sequence[str]] = None) -> List[str]:
    """The launcher command line that runs ``program`` on ``np`` ranks with all of ``environ``,
    or with only the variables named in ``forward`` (taken from ``environ``, the launcher's
    environment): then the rest of a rank's environment is its proxy's.

    Hydra forwards the whole environment with -genvall (a list with -genvlist), fills each
    host's slots in turn and oversubscribes by default; Open MPI needs ``-x NAME`` per
    variable, a by-slot mapping that may oversubscribe (unless ``mpi_args`` map the ranks
    themselves), and --allow-run-as-root under root.
    """
    names = sorted(environ) if forward is None else sorted(set(forward) & set(environ))
    command = [launcher.path, "-n", str(np)]
    host_list = ",".join(f"{host}:{slots}" for host, slots in hosts)
    if launcher.flavour == OPENMPI:
        # --oversubscribe alone maps by core and so put every rank on the first host,
        # whatever the slots said.
        if not any(arg.lstrip("-") == "map-by" or arg.startswith(("--map-by=", "-map-by="))
                   for arg in mpi_args):
            command += ["--map-by", "slot:OVERSUBSCRIBE"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")
        if hosts:
            command += ["-H", host_list]
        for name in names:
            if _VARIABLE_NAME.match(name) and not name.startswith(_OPENMPI_PRIVATE_PREFIXES):
                command += ["-x", name]
    else:
        listed = [name for name in names if _VARIABLE_NAME.match(name)]  # no comma in them
        command += (["-genvall"] if forward is None else
                    ["-genvlist", ",".join(listed)] if listed else ["-genvnone"])
        if hosts:
            command += ["-hosts", host_list]
    return command + list(mpi_args) + list(program)


def variable_name_error(name: object) -> Optional[str]:
    """Why ``name`` cannot be an environment variable that both MPIs pass to the ranks (a
    str of letters, digits and underscores, not starting with a digit), or None."""
    if not isinstance(name, str):
        return f"{name!r} is a {type(name).__name__}, not a str"
    if not _VARIABLE_NAME.match(name):
        return (f"{name!r} is not a variable name (letters, digits and underscores, not "
                "starting with a digit)")
    return None


SHARED_MEMORY = "/dev/shm"
# The /dev/shm files in which MPI keeps its shared memory: MPICH one per host and job, Open MPI
# one per rank (Open MPI 4 named it vader_segment).
SEGMENT_PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.")
# Bytes of /dev/shm each rank on a host takes, as measured: MPICH 5.0's segment is 2,118,784
# bytes for 2 ranks and 3,176,128 for 3 (about 1 MiB a rank); Open MPI 5.0's is 16 MiB a rank.
_SEGMENT_BYTES_PER_RANK = {HYDRA: 1_057_344, OPENMPI: 16 << 20}


def shared_memory_needed(flavour: str, ranks: int) -> int:
    """About how many bytes of /dev/shm ``ranks`` ranks on one host take for MPI's segments."""
    return _SEGMENT_BYTES_PER_RANK.get(flavour, _SEGMENT_BYTES_PER_RANK[OPENMPI]) * ranks


def shared_memory_free() -> Optional[int]:
    """Bytes free in /dev/shm for this user; None where there is none."""
    try:
        info = os.statvfs(SHARED_MEMORY)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def shared_memory_advice(flavour: str, ranks: int) -> Optional[str]:
    """What to say when /dev/shm has less room than ``ranks`` ranks here need, else None."""
    free, needed = shared_memory_free(), shared_memory_needed(flavour, ranks)
    if free is None or free >= needed:
        return None
    return (f"{SHARED_MEMORY} has {_mib(free)} free, and {FLAVOUR_NAMES.get(flavour, flavour)} "
            f"needs about {_mib(needed)} there for {ranks} rank{'s' if ranks > 1 else ''} on "
            f"this host (ranks that find it full die of SIGBUS, code 135); remove stale files "
            f"there (ls -la {SHARED_MEMORY}) or make it larger (mount -o remount,size=... "
            f"{SHARED_MEMORY}; docker run --shm-size=...)")


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB"
