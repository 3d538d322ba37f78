"""hvdrun's output relay on hand-written mpiexec output, and what it makes of the wrappers'
reports: lines joined per rank however mpiexec interleaves them, output never read as a
report, the first failure chosen by exit time rather than by arrival, hosts named, and a job
whose mpiexec exits 0 before every rank reported its exit failed."""
import io
import signal
import sys
import threading
import time

from hvd_trainer_launch import protocol
from hvd_trainer_launch.job import relay as output, watch as job
from hvd_trainer_launch.protocol import Exited, Started


def relayed(lines, hosts=(), reports=(), no_prefix=False, output_dir=None):
    """Relay ``lines`` (bytes) as mpiexec's stderr after delivering ``reports``; return (the
    relay, what the user sees)."""
    relay = output.OutputRelay(4, no_prefix, output_dir, hosts)
    for report in reports:
        relay.deliver(report)
    out = io.BytesIO()
    relay.relay(io.BytesIO(b"".join(lines)), out)
    relay.close()
    return relay, out.getvalue()


def test_report_lines_in_the_output_are_only_shown():
    # What the wrappers wrote into the output before reports had a port of their own.
    lines = [b"\0#hvdrun-exit rank=1 code=14 at=10.5\n", b"#hvdrun-start rank=2 host=h2\n",
             b"[0]<stderr>:#hvdrun-exit rank=1 code=7 at=1.0\n"]
    relay, seen = relayed(lines)
    assert seen == b"".join(lines)
    assert relay.reported == [] and relay.started == set() and relay.settle() is None


def test_pieces_of_long_lines_are_joined_per_rank_and_stream(tmp_path):
    # Hydra may put other ranks' lines between the pieces of one rank's long line.
    long0 = b"a" * 10000
    pieces0 = protocol.pieces(b"[0]<stdout>:", b"[0]<stdout>+", long0)
    pieces2 = protocol.pieces(b"[2]<stderr>:", b"[2]<stderr>+", b"b" * 5000)
    assert len(pieces0) == 3 and all(len(p) <= protocol.PIECE_BYTES for p in pieces0)
    lines = [pieces0[0], b"[1]<stdout>:short\n", pieces2[0], pieces0[1],
             b"mpiexec says\n", pieces2[1], pieces0[2]]
    _, seen = relayed(lines)
    assert seen.split(b"\n") == [b"[1]<stdout>:short", b"mpiexec says", b"[2]<stderr>:" + b"b" * 5000,
                                 b"[0]<stdout>:" + long0, b""]
    _, bare = relayed(lines, no_prefix=True, output_dir=str(tmp_path))
    assert bare.split(b"\n") == [b"short", b"mpiexec says", b"b" * 5000, long0, b""]
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == long0 + b"\n"
    assert (tmp_path / "rank.2" / "stderr").read_bytes() == b"b" * 5000 + b"\n"
    assert (tmp_path / "rank.1" / "stdout").read_bytes() == b"short\n"


def test_a_line_cut_off_by_the_end_of_the_output_is_shown_as_far_as_it_came():
    _, seen = relayed([b"[3]<stdout>+abc\n", b"[3]<stdout>+def\n"])
    assert seen == b"[3]<stdout>:abcdef\n"


def test_the_reports_name_the_ranks_started_and_failed():
    relay, _ = relayed([], reports=[Started(2, "h2"), Exited(1, 14, 10.5)])
    assert [(f.rank, f.code, f.at, f.how) for f in relay.reported] == \
        [(1, 14, 10.5, "exited with code")]
    assert relay.started == {2} and relay.hosts == {2: "h2"}


def test_an_exit_with_code_0_is_an_exit_not_a_failure():
    relay, _ = relayed([], reports=[Started(0, "h"), Started(1, "h"), Exited(0, 0, 10.0)])
    assert relay.exited == {0} and relay.reported == [] and relay.settle() is None
    assert relay.unexited(0) == [1]


def _job_ending_0(relay):
    """hvdrun's exit code for an mpiexec that exits 0 at once, reported to ``relay``."""
    return job.run_job([sys.executable, "-c", "pass"], {}, relay, np=3)


def test_mpiexec_exiting_0_while_a_started_rank_never_reported_its_exit_fails_the_job(
        monkeypatch, capsys):
    # Open MPI's mpirun exits 0 when it loses a host's daemon (an engine's agent killed),
    # sooner than the wrappers there end their ranks and report.
    monkeypatch.setattr(job, "EXIT_REPORT_GRACE_SECONDS", 0.3)
    relay, _ = relayed([], reports=[Started(rank, "h") for rank in range(3)]
                       + [Exited(0, 0, 1.0), Exited(2, 0, 1.0)])
    assert _job_ending_0(relay) == 1
    assert "exited with code 0, but rank 1 never reported an exit" in capsys.readouterr().err


def test_a_rank_that_reports_its_failure_after_mpiexec_exited_0_is_named(monkeypatch, capsys):
    relay, _ = relayed([], reports=[Started(rank, "h") for rank in range(3)]
                       + [Exited(0, 0, 1.0), Exited(2, 0, 1.0)])
    late = threading.Timer(0.5, relay.deliver, [Exited(1, 143, time.time())])
    late.start()
    assert _job_ending_0(relay) == 143
    late.join()
    assert "rank 1 exited with code 143 (first failure)" in capsys.readouterr().err


def test_a_job_whose_ranks_all_reported_their_exits_ends_with_mpiexecs_code():
    relay, _ = relayed([], reports=[Started(rank, "h") for rank in range(3)]
                       + [Exited(rank, 0, 1.0) for rank in range(3)])
    assert _job_ending_0(relay) == 0


def test_the_earliest_exit_the_launcher_did_not_cause_is_the_first_failure(capsys):
    # A survivor that mpirun terminated (ended) reports first, from the launching host; the
    # rank killed on the remote host exited earlier, and one that aborted on losing it later.
    relay, _ = relayed([], reports=[Exited(0, 143, 100.40, ended=True), Exited(1, 14, 100.30),
                                    Exited(3, 137, 100.20)],
                       hosts=[("h1", 2), ("h2", 2)])
    failure = relay.settle()
    assert (failure.rank, failure.code) == (3, 137)
    assert capsys.readouterr().err == \
        "hvdrun: rank 3 on h2 exited with code 137 (first failure); ending the job\n"
    relay.record(2, 1, "exited with code", 99.0)  # settled: later reports change nothing
    assert relay.settle() is failure


def test_a_rank_killed_by_a_signal_comes_before_survivors_that_aborted_just_earlier(capsys):
    # Seen under Open MPI at load 3 (issue 22): rank 3 killed -9 on h2, its wrapper saw it
    # 3.3 ms after rank 1's MPI had aborted on the lost connection (code 14).
    relay, _ = relayed([], reports=[Exited(1, 14, 831.075502),
                                    Exited(0, 143, 831.132837, killed=True, ended=True),
                                    Exited(2, 14, 831.082548), Exited(3, 137, 831.078771, killed=True)],
                       hosts=[("h1", 2), ("h2", 2)])
    failure = relay.settle()
    assert (failure.rank, failure.code) == (3, 137)
    assert capsys.readouterr().err == \
        "hvdrun: rank 3 on h2 exited with code 137 (first failure); ending the job\n"


def test_a_rank_killed_long_after_another_failed_is_not_the_first_failure():
    relay, _ = relayed([], reports=[Exited(0, 1, 100.0), Exited(2, 137, 101.5, killed=True)])
    assert relay.settle().rank == 0


def test_an_exit_code_of_a_killed_rank_without_the_killed_word_is_an_exit():
    # sys.exit(137) is a script's own exit: only the wrapper's report says "killed".
    relay, _ = relayed([], reports=[Exited(0, 1, 100.0), Exited(2, 137, 100.1)])
    assert relay.settle().rank == 0


def test_ranks_the_launcher_ended_are_blamed_only_when_no_other_failed():
    relay, _ = relayed([], reports=[Exited(2, 143, 5.0, ended=True),
                                    Exited(1, 143, 4.0, ended=True)])
    assert relay.settle().rank == 1


def test_hosts_are_named_only_for_a_job_on_several_hosts():
    one, _ = relayed([], reports=[Started(1, "node7")], hosts=[("node7", 4)])
    assert one.ranks([1]) == "rank 1"
    several, _ = relayed([], reports=[Started(3, "b")], hosts=[("a", 2), ("b", 2)])
    # A rank that reported is named by its report, one that did not by its slot.
    assert several.ranks([3]) == "rank 3 on b"
    assert several.ranks([0, 1, 2]) == "ranks 0, 1, 2 on a, b"


def test_mpiexec_left_waiting_only_for_ranks_that_never_started_is_killed_without_the_grace(
        monkeypatch):
    # Hydra's mpiexec, told to end, still waits for the proxies of ranks that never started
    # (their engine agent lost); once every started rank has exited and reported, nothing
    # needs the kill grace (it delayed the next elastic life on Ray by 5 s).
    monkeypatch.setattr(job, "KILL_GRACE_SECONDS", 60.0)
    relay, _ = relayed([], reports=[Started(0, "h"), Started(1, "h"), Exited(0, 1, 1.0),
                                    Exited(1, 143, 1.1, ended=True)])  # ranks 2, 3 never
    lingering = [sys.executable, "-c", "import time; time.sleep(600)"]
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited: mpiexec ignores it
    try:
        began = time.monotonic()
        code = job.run_job(lingering, {}, relay, np=4, failure_grace=0.0)
        took = time.monotonic() - began
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 1  # rank 0's
    assert took < job.KILL_GRACE_SECONDS, "mpiexec was given the grace"
