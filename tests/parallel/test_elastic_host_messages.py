"""Horovod's private ``state._host_messages.empty()``, which Horovod's own elastic test scripts
poll on rank 0 while they wait for a host change (tests/peer/run_peer_suites.py runs them):
it is True until hvdrun tells of other hosts, and that notice restarts the job on them at the
very next commit, with nothing committed lost."""
import pytest

from runner import run_ranks
from test_elastic import discovery, lives


@pytest.mark.parametrize("np_,grown", [(2, 3), (3, 2)])
def test_host_messages_tell_of_a_change_that_the_next_commit_acts_on(tmp_path, np_, grown):
    script = discovery(tmp_path, f"localhost:{np_}")
    proc = run_ranks("elastic_host_messages.py", np_,
                     [str(tmp_path / "hosts"), f"localhost:{grown}"],
                     hvdrun_args=["--min-np", "2", "--max-np", "3",
                                  "--host-discovery-script", script])
    assert "EMPTY before=True" in proc.stdout
    assert "NOTICE step=2" in proc.stdout
    assert "NO INTERRUPT" not in proc.stdout
    # The second life starts on the new hosts at the step of the commit after the notice.
    assert lives(proc.stdout) == [(np_, 0), (grown, 2)]
    assert proc.stderr.count("hosts changed to") == 1
