"""An elastic engine job (engines.elastic) changes in place under MPICH: hvdrun offers a
growth onto hosts where the life runs no rank yet (an agent runs one proxy line at a time),
tells the engine launch which hosts Hydra's next proxy lines are for before the ranks hear of
the offer, and ends the life when the engine loses the agent of a host the ranks are spawning
on; it offers a removal where every rank says it runs on hvdrun's machine; the engine job
adds the new hosts' ranks to the life's, and Horovod's driver view of the newest life
(ElasticRayExecutor.driver) reads it. Checked against hand-made layouts."""
import io
import socket

import pytest

from hvd_trainer_launch import mpi, offers, protocol
from hvd_trainer_launch.elastic import watcher
from hvd_trainer_launch.elastic.registration import Blacklist, ElasticRelay
from hvd_trainer_launch.elastic.resizing import Resizer
from hvd_trainer_launch.engines import elastic, launch as engine_launch
from test_engine_lost_agents import GenerationCount, Hosts

RUNNING = [("hvd-agent0-a", 2)]


def engine_resizer(flavour=mpi.HYDRA):
    return Resizer(flavour, ["python", "-m", "rank"], ["hvd-agent0-a"], local=False,
                   engine=True)


def test_an_engine_job_grows_in_place_onto_new_hosts_under_mpich():
    offer = engine_resizer().growth(3, 2, RUNNING, [("hvd-agent1-b", 1), ("hvd-agent2-c", 1)])
    assert offer.places == [offers.SpawnPlace(2, {"hosts": "hvd-agent1-b,hvd-agent2-c"})]


@pytest.mark.parametrize("flavour, added", [
    (mpi.HYDRA, [("hvd-agent0-a", 1)]),   # its agent runs the life's line already
    (mpi.HYDRA, [("hvd-agent1-b", 1), ("hvd-agent0-a", 1)]),
    (mpi.OPENMPI, [("hvd-agent1-b", 1)]),  # mpirun's daemons lack the ranks' variables
])
def test_an_engine_job_restarts_where_an_agent_would_run_two_lines_or_under_open_mpi(flavour,
                                                                                     added):
    assert engine_resizer(flavour).growth(3, 2, RUNNING, added) is None


@pytest.mark.parametrize("machines, in_place", [
    ([socket.gethostname()] * 3, True),                      # every agent on hvdrun's machine
    ([socket.gethostname()] * 2 + ["elsewhere.invalid"], False),  # MPICH's finalize fails
    ([socket.gethostname()] * 2 + [None], False),            # a rank that never said
    ([], False),
])
def test_an_engine_job_shrinks_in_place_where_its_ranks_say_they_run_here(machines, in_place):
    # The agents' names are no machine's: the ranks' own reports say where they run.
    removal = engine_resizer().removal(3, [("hvd-agent0-a", 2), ("hvd-agent1-b", 1)], [2],
                                       machines)
    assert (removal == offers.Removal(3, [2])) if in_place else removal is None


def growing_watcher(announced, found):
    relay = ElasticRelay(2, False, None, RUNNING)
    relay.started.update({0, 1})
    return watcher.HostWatcher(Hosts(found), Blacklist(None), list(RUNNING), None,
                               GenerationCount(), relay, resizer=engine_resizer(),
                               announce=announced.append)


def test_the_hosts_of_a_growth_are_announced_before_the_ranks_hear_of_it():
    announced = []
    watch = growing_watcher(announced, RUNNING + [("hvd-agent1-b", 1)])
    watch.generation.changed = lambda offer: announced.append(offers.read_offer(offer))
    watch.check_hosts()
    assert announced[0] == [("hvd-agent1-b", 1)]
    assert isinstance(announced[1], offers.Growth)


def test_an_agent_lost_before_the_ranks_it_was_to_start_ends_the_life(tmp_path):
    watch = growing_watcher([], RUNNING + [("hvd-agent1-b", 2)])
    watch.check_hosts()
    lost = tmp_path / "lost"
    lost.write_text(protocol.lost_line(
        protocol.LostHost(0, "hvd-agent1-b", "its node died", False)) + "\n")
    watch.lost_file = str(lost)
    watch.take_lost()
    # The new ranks would have been 2 and 3: the life fails with the first of them.
    assert watch.relay.failure.rank == 2 and sorted(watch.relay.failed) == [2, 3]


def test_the_ranks_of_a_growth_come_after_the_life_s_others():
    dispatched = []
    job = elastic.ElasticJob(b"payload", flavour=mpi.HYDRA, settings=elastic.ElasticSettings(),
                             serve=dispatched.append)
    job.joined("a", 2)
    job.joined("b", 1)
    names = {host: engine_launch.agent_name(index, host) for index, host in enumerate("ab")}
    job._handed(engine_launch.LifeLines(0, [engine_launch.HostRanks(names["a"], 2)], ["A"]))
    job._handed(engine_launch.LifeLines(0, [engine_launch.HostRanks(names["b"], 1)], ["B"]))
    assert dispatched == [elastic.Dispatch(0, "a", "A"), elastic.Dispatch(0, "b", "B")]
    assert job._lives[0].hosts == [("a", 2), ("b", 1)]


def test_horovod_s_driver_view_gives_each_slot_of_the_newest_life():
    from hvd_trainer_launch.engines.ray_elastic import ElasticDriver
    job = elastic.ElasticJob(b"payload", flavour=mpi.HYDRA, settings=elastic.ElasticSettings(),
                             serve=lambda dispatch: None)
    driver = ElasticDriver(job)
    assert driver.get_slot_info("a", 0) == elastic.NO_SLOT  # no life yet
    for host, slots in (("a", 2), ("b", 1)):
        job.joined(host, slots)
    name = engine_launch.agent_name
    job._handed(engine_launch.LifeLines(0, [engine_launch.HostRanks(name(0, "a"), 2),
                                            engine_launch.HostRanks(name(1, "b"), 1)],
                                        ["A", "B"]))
    # Horovod's numbering: rank 2 is b's first, the second of the hosts with a local rank 0.
    assert driver.get_slot_info("b", 0) == elastic.SlotInfo("b", 2, 0, 1, 3, 1, 2)
    assert driver.get_slot_info("a", 1) == elastic.SlotInfo("a", 1, 1, 0, 3, 2, 1)
    assert driver.get_slot_info("b", 1) == elastic.NO_SLOT
    assert driver.get_worker_client(driver.get_slot_info("b", 0)) == elastic.Dispatch(0, "b", "B")
    assert not driver.get_worker_client(elastic.NO_SLOT)


def test_a_growth_whose_ranks_never_start_fails_the_life_after_the_start_timeout():
    now = [100.0]
    watch = growing_watcher([], RUNNING + [("hvd-agent1-b", 2)])
    watch.clock, watch.start_timeout = (lambda: now[0]), 5.0
    relay = watch.relay
    relay.relay(io.BytesIO(b"HYDRA_LAUNCH: life\nHYDRA_LAUNCH_END\n"), io.BytesIO())
    watch.check_hosts()  # the growth is offered after the life's own block
    watch.check_resized()
    assert relay.failure is None  # the spawn has not begun: no proxy lines handed out yet
    relay.relay(io.BytesIO(b"HYDRA_LAUNCH: b\nHYDRA_LAUNCH_END\n"), io.BytesIO())
    relay.launch_blocks[-1] = now[0]  # handed out now, by the watcher's clock
    now[0] += 4.0
    watch.check_resized()
    assert relay.failure is None  # within the start timeout
    now[0] += 2.0
    watch.check_resized()
    # The new ranks would have been 2 and 3: the life fails naming them.
    assert relay.failure is not None and relay.failure.rank == 2
    assert relay.failure.how == "did not start"
