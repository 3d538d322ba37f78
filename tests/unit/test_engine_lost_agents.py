"""hvdrun's side of the agents an elastic engine job loses (elastic/watcher.py,
ElasticRelay.agent_lost) and the engines' ``ulfm`` choice: a lost agent's ranks end the life
at once (they will never start or report), or under --ulfm, when they had started, count as
killed so that the others go on; then the hosts of the ranks that went on are the life's
layout, and a host that comes back grows the job."""

import pytest

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.elastic import watcher
from hvd_trainer_launch.elastic.registration import Blacklist, ElasticRelay
from hvd_trainer_launch.engines import elastic
from hvd_trainer_launch.job.relay import ENDED

LAYOUT = [("a", 2), ("b", 1), ("c", 1)]


class Hosts:
    """A discovery that answers what the test says."""

    def __init__(self, hosts):
        self.now = hosts

    def hosts(self):
        return list(self.now)

    def stop(self):
        pass


class GenerationCount:
    """The notice port's generation, without the port."""

    def __init__(self):
        self.number, self.offer = 0, b""

    def changed(self, offer=b""):
        self.number, self.offer = self.number + 1, offer


def _watcher(relay, discovery, lost_file=None, life=0, clock=lambda: 0.0):
    found = watcher.HostWatcher(discovery, Blacklist(None), list(LAYOUT), None,
                                GenerationCount(), relay, life, clock)
    found.lost_file = lost_file
    return found


def _relay(in_place, started=range(4)):
    relay = ElasticRelay(4, False, None, LAYOUT, in_place)
    relay.started.update(started)
    return relay


def test_a_lost_line_reads_back_and_damaged_lines_are_skipped():
    lost = protocol.LostHost(2, "hvd-agent1-b", "its actor died")
    text = protocol.lost_line(lost) + "\n{\n" + '{"life": "x", "host": "c"}\n'
    assert protocol.parse_lost(text) == [lost]


def test_the_ranks_of_a_host_and_the_layout_without_ranks():
    assert watcher.ranks_of(LAYOUT, "a") == [0, 1]
    assert watcher.ranks_of(LAYOUT, "c") == [3]
    assert watcher.ranks_of(LAYOUT, "d") == []
    assert watcher.survivors(LAYOUT, [1, 3]) == [("a", 1), ("b", 1)]
    assert watcher.survivors(LAYOUT, []) == LAYOUT


def test_a_lost_agent_ends_the_life_with_its_ranks_failure(capsys):
    relay = _relay(in_place=False)
    relay.agent_lost([3], "its actor died")
    assert relay.failure is not None and relay.failure.rank == 3 and relay.failure.code == 1
    assert relay.blamed(LAYOUT) == {"c"}
    assert relay.unexited(0) == [0, 1, 2]  # rank 3 will not report: none is waited for
    assert "the engine lost the agent of rank 3 on c (its actor died); ending this life" \
        in capsys.readouterr().err
    relay.agent_lost([2], "")  # the life is ending: nothing more is recorded
    assert [failure.rank for failure in relay.reported] == [3]


def test_under_ulfm_the_started_ranks_of_a_lost_agent_count_as_killed(capsys):
    relay = _relay(in_place=True)
    relay.agent_lost([0, 1], "its link closed")
    assert relay.failure is None and relay.gone_in_place() == [0, 1]
    assert relay.survived(2) and not relay.survived(3)
    assert "the engine lost the agent of ranks 0, 1 on a (its link closed); under --ulfm the " \
           "other ranks go on without them" in capsys.readouterr().err


def test_under_ulfm_ranks_that_never_started_still_end_the_life():
    relay = _relay(in_place=True, started=[0, 1, 2])
    relay.agent_lost([3], "")
    assert relay.failure is not None and relay.failure.rank == 3
    assert relay.gone_in_place() == []


def test_ranks_that_reported_their_end_are_not_lost_again():
    relay = _relay(in_place=True)
    relay.deliver(protocol.Exited(3, 143, 0.0, killed=True))
    relay.agent_lost([3], "")
    assert [failure.rank for failure in relay.reported] == [3]


def test_the_watcher_takes_each_agent_lost_in_its_life_once(tmp_path):
    path = tmp_path / "lost"
    path.write_text("".join(protocol.lost_line(lost) + "\n" for lost in (
        protocol.LostHost(0, "c", "gone"), protocol.LostHost(1, "b", "later life"))))
    relay = _relay(in_place=True)
    watch = _watcher(relay, Hosts(LAYOUT), str(path), life=0)
    watch.take_lost()
    watch.take_lost()
    assert relay.gone_in_place() == [3]  # not b: lost in another life


def test_an_agent_gone_before_the_life_began_ends_it_but_is_not_counted_again(tmp_path):
    # A node is lost: its rank's failure ends life 0 (c counts one failed life). hvdrun reads
    # the hosts for life 1 before the engine has seen the loss, so life 1 is laid out on c
    # too and the engine says its agent was absent. That life ends at once, but c must not
    # count a second failed life (two put it out for the rest of the job, and it could not
    # grow the job back when it returns).
    blacklist = Blacklist(None)
    life0 = _relay(in_place=False)
    life0.record(3, 137, "was killed by signal")
    assert life0.blamed(LAYOUT) == {"c"}
    assert blacklist.life_ended(["a", "b", "c"], {"c"}) == []
    path = tmp_path / "lost"
    path.write_text(protocol.lost_line(protocol.LostHost(1, "c", "gone", absent=True)) + "\n")
    life1 = _relay(in_place=False, started=[])
    _watcher(life1, Hosts(LAYOUT), str(path), life=1).take_lost()
    assert life1.failure is not None and life1.failure.rank == 3  # the life ends at once
    assert life1.blamed(LAYOUT) == set()  # not c, nor the hosts whose ranks never started
    unsure = {"c"}  # as driver._after: the hosts of the ranks that failed
    assert blacklist.life_ended(["a", "b", "c"], life1.blamed(LAYOUT), unsure) == []
    assert blacklist.usable(LAYOUT) == LAYOUT
    # Without the engine's word that it was absent, the same life would put c out.
    again = Blacklist(None)
    again.life_ended(["a", "b", "c"], {"c"})
    assert again.life_ended(["a", "b", "c"], {"c"}) == ["c"]


def test_an_absent_agent_reads_back_from_the_engines_file(tmp_path):
    lost = protocol.LostHost(4, "hvd-agent2-c", "its actor was gone", absent=True)
    assert protocol.parse_lost(protocol.lost_line(lost)) == [lost]
    assert protocol.parse_lost('{"life": 4, "host": "c", "cause": ""}')[0].absent is False


def test_without_ulfm_a_host_gone_restarts_the_job_at_the_next_commit():
    discovery = Hosts(LAYOUT)
    watch = _watcher(_relay(in_place=False), discovery)
    watch.check_hosts()
    assert watch.generation.number == 0
    discovery.now = LAYOUT[:2]
    watch.check_hosts()
    assert watch.generation.number == 1


def test_under_ulfm_the_hosts_of_the_ranks_that_went_on_become_the_layout(capsys):
    relay, discovery = _relay(in_place=True), Hosts(LAYOUT)
    watch = _watcher(relay, discovery)
    relay.agent_lost([3], "")
    watch.check_hosts()  # c still discovered: the life goes on as it is
    discovery.now = LAYOUT[:2]
    watch.check_hosts()  # c gone: the survivors' layout, no restart
    assert watch.generation.number == 0 and watch.layout == LAYOUT[:2]
    assert "the hosts are those of the ranks that went on (a:2,b:1)" in capsys.readouterr().err
    discovery.now = LAYOUT
    watch.check_hosts()  # c back: the job grows at the next commit
    assert watch.generation.number == 1


def test_the_engines_ulfm_choice(monkeypatch):
    monkeypatch.delenv(elastic.ULFM_VARIABLE, raising=False)
    assert not elastic.ulfm_wanted(None, mpi.OPENMPI, "here")
    assert elastic.ulfm_wanted(True, mpi.OPENMPI, "here")
    monkeypatch.setenv(elastic.ULFM_VARIABLE, "1")
    assert elastic.ulfm_wanted(None, mpi.OPENMPI, "here")
    assert not elastic.ulfm_wanted(False, mpi.OPENMPI, "here")
    with pytest.raises(ValueError, match="here: ulfm needs Open MPI 5.*MPICH"):
        elastic.ulfm_wanted(None, mpi.HYDRA, "here")
    monkeypatch.setenv(elastic.ULFM_VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"\$HVD_ELASTIC_ULFM='yes'; give 1"):
        elastic.ulfm_wanted(None, mpi.OPENMPI, "here")


def test_under_ulfm_ranks_the_launcher_ended_are_not_said_to_be_left_behind(capsys):
    """Open MPI's runtime ends every rank when it loses a host's daemon: those ends are the
    life's, not ranks the others go on without."""
    relay = _relay(in_place=True)
    relay.record(1, 143, ENDED, killed=True)
    assert "go on without" not in capsys.readouterr().err
    assert relay.gone_in_place() == []  # nor held out of the layout as if they had
    relay.settle()
    assert "rank 1 on a was ended by the launcher, with code 143; ending this life" in \
        capsys.readouterr().err


def test_under_ulfm_a_loss_written_as_the_discovery_runs_is_taken_before_the_hosts(tmp_path):
    # The engine writes the lost line, then the hosts without c, after the watcher's round
    # read the lost file and before it ran the discovery (CI's Open MPI pass lost a Spark
    # ULFM test to this order: every rank restarted instead of the survivors going on).
    path = tmp_path / "lost"
    path.write_text("")
    relay = _relay(in_place=True)

    class EngineWritesNow(Hosts):
        def hosts(self):
            path.write_text(protocol.lost_line(protocol.LostHost(0, "c", "gone")) + "\n")
            return LAYOUT[:2]

    watch = _watcher(relay, EngineWritesNow(LAYOUT), str(path))
    watch.take_lost()  # the round's first read: nothing lost yet
    watch.check_hosts()
    assert relay.gone_in_place() == [3]
    assert watch.generation.number == 0 and watch.layout == LAYOUT[:2]


class Clock:
    """A clock that moves when the test says."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _killed(relay, rank):
    """``rank`` killed by a signal, as its wrapper reports it."""
    relay.record(rank, 137, "exited with code", killed=True)


def test_under_ulfm_a_rank_killed_on_a_host_still_listed_is_replaced_after_the_hold(capsys):
    """A rank killed on a host that stays up (the OOM killer): the others go on without it
    and its slot stays out for the hold, then the job grows back onto it at the next commit
    (before, it never did while the discovery listed the host)."""
    clock, relay, discovery = Clock(), _relay(in_place=True), Hosts(LAYOUT)
    watch = _watcher(relay, discovery, clock=clock)
    _killed(relay, 1)
    watch.check_hosts()
    assert watch.generation.number == 0 and watch.layout == [("a", 1), ("b", 1), ("c", 1)]
    assert "the hosts are those of the ranks that went on (a:1,b:1,c:1)" in capsys.readouterr().err
    clock.now += watcher.KILLED_SLOT_HOLD_SECONDS - 1
    watch.check_hosts()
    assert watch.generation.number == 0
    clock.now += 1
    watch.check_hosts()
    assert watch.generation.number == 1
    assert "hosts changed to a:2,b:1,c:1" in capsys.readouterr().err


def test_under_ulfm_a_killed_rank_s_slot_listed_again_after_the_discovery_dropped_it_grows_at_once():
    clock, relay, discovery = Clock(), _relay(in_place=True), Hosts(LAYOUT)
    watch = _watcher(relay, discovery, clock=clock)
    _killed(relay, 1)
    watch.check_hosts()
    discovery.now = [("a", 1), ("b", 1), ("c", 1)]  # the discovery saw the slot go
    watch.check_hosts()
    assert watch.generation.number == 0
    discovery.now = LAYOUT  # and lists it again, well within the hold
    clock.now += 2
    watch.check_hosts()
    assert watch.generation.number == 1


def test_under_ulfm_a_free_slot_grows_the_job_at_once_while_the_killed_one_is_held():
    clock, relay, discovery = Clock(), _relay(in_place=True), Hosts(LAYOUT)
    watch = _watcher(relay, discovery, clock=clock)
    _killed(relay, 3)
    discovery.now = LAYOUT + [("d", 1)]  # c's slot is held; d's is free
    watch.check_hosts()
    assert watch.generation.number == 1


def test_without_ulfm_a_killed_rank_holds_nothing():
    # Its life ends (every rank restarts at once on the listed hosts): no hold to apply.
    relay, discovery = _relay(in_place=False), Hosts(LAYOUT)
    watch = _watcher(relay, discovery)
    _killed(relay, 1)
    watch.check_hosts()
    assert watch.holds == {} and watch.generation.number == 0
