"""hvdrun's output relay on hand-written mpiexec output: markers hidden wherever they stand,
the first failure chosen by exit time rather than by arrival, hosts named."""
import io

from hvd_trainer_launch import hvdrun


def relayed(lines, hosts=()):
    """Relay ``lines`` (bytes) as mpiexec's stderr; return (the relay, what the user sees)."""
    relay = hvdrun.OutputRelay(4, False, None, hosts)
    out = io.BytesIO()
    relay.relay(io.BytesIO(b"".join(lines)), out)
    return relay, out.getvalue()


def test_markers_behind_nuls_or_other_text_are_read_and_hidden():
    # Open MPI's abort message leaves a NUL before the next line of the stream.
    relay, seen = relayed([b"\0#hvdrun-exit rank=1 code=14 at=10.5\n",
                           b"prterun says#hvdrun-start rank=2 host=h2\n",
                           b"[0]<stderr>:plain line\n"])
    assert seen == b"prterun says\n[0]<stderr>:plain line\n"
    assert [(f.rank, f.code, f.at, f.how) for f in relay.reported] == \
        [(1, 14, 10.5, "exited with code")]
    assert relay.started == {2} and relay.hosts == {2: "h2"}


def test_the_earliest_exit_the_launcher_did_not_cause_is_the_first_failure(capsys):
    # A survivor that mpirun terminated (ended) reports first, from the launching host; the
    # rank killed on the remote host exited earlier, and one that aborted on losing it later.
    relay, _ = relayed([b"#hvdrun-exit rank=0 code=143 at=100.40 ended\n",
                        b"#hvdrun-exit rank=1 code=14 at=100.30\n",
                        b"#hvdrun-exit rank=3 code=137 at=100.20\n"],
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
    relay, _ = relayed([b"#hvdrun-exit rank=1 code=14 at=831.075502\n",
                        b"#hvdrun-exit rank=0 code=143 at=831.132837 killed ended\n",
                        b"#hvdrun-exit rank=2 code=14 at=831.082548\n",
                        b"#hvdrun-exit rank=3 code=137 at=831.078771 killed\n"],
                       hosts=[("h1", 2), ("h2", 2)])
    failure = relay.settle()
    assert (failure.rank, failure.code) == (3, 137)
    assert capsys.readouterr().err == \
        "hvdrun: rank 3 on h2 exited with code 137 (first failure); ending the job\n"


def test_a_rank_killed_long_after_another_failed_is_not_the_first_failure():
    relay, _ = relayed([b"#hvdrun-exit rank=0 code=1 at=100.0\n",
                        b"#hvdrun-exit rank=2 code=137 at=101.5 killed\n"])
    assert relay.settle().rank == 0


def test_an_exit_code_of_a_killed_rank_without_the_killed_word_is_an_exit():
    # sys.exit(137) is a script's own exit: only the wrapper's word says "killed".
    relay, _ = relayed([b"#hvdrun-exit rank=0 code=1 at=100.0\n",
                        b"#hvdrun-exit rank=2 code=137 at=100.1\n"])
    assert relay.settle().rank == 0


def test_ranks_the_launcher_ended_are_blamed_only_when_no_other_failed():
    relay, _ = relayed([b"#hvdrun-exit rank=2 code=143 at=5.0 ended\n",
                        b"#hvdrun-exit rank=1 code=143 at=4.0 ended\n"])
    assert relay.settle().rank == 1


def test_hosts_are_named_only_for_a_job_on_several_hosts():
    one, _ = relayed([b"#hvdrun-start rank=1 host=node7\n"], hosts=[("node7", 4)])
    assert one.ranks([1]) == "rank 1"
    several, _ = relayed([b"#hvdrun-start rank=3 host=b\n"], hosts=[("a", 2), ("b", 2)])
    # A rank that reported is named by its report, one that did not by its slot.
    assert several.ranks([3]) == "rank 3 on b"
    assert several.ranks([0, 1, 2]) == "ranks 0, 1, 2 on a, b"
