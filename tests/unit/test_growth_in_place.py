"""Changing an elastic job in place, the parts that need no MPI job: which host changes hvdrun
grows or shrinks a life in place (elastic/resizing.py) and its offers, the offers' and the new
rank's formats (offers.py) and their signature, the watcher and the relay taking the new ranks
in and the leaving ones out, the new rank's Horovod variables, and the ranks reading the
offer. The changes themselves run under MPICH and Open MPI in tests/parallel (test_elastic.py,
test_torch_elastic.py, test_ulfm.py) and tests/multihost (test_multihost_growth.py)."""
import json
import socket
import threading

import pytest

from hvd_trainer_launch import mpi, offers, protocol
from hvd_trainer_launch.elastic import watcher
from hvd_trainer_launch.elastic.resizing import WRAPPER, Resizer, added_slots, removed_places
from hvd_trainer_launch.elastic.notices import Generation
from hvd_trainer_launch.elastic.registration import Blacklist, ElasticRelay
from hvd_trainer_launch.rank import wrapper
from test_engine_lost_agents import GenerationCount, Hosts

SECRET = b"the job's secret"
HERE = "localhost"


@pytest.mark.parametrize("running, found, added", [
    ([("a", 2)], [("a", 3)], [("a", 1)]),                           # a slot more on a host
    ([("a", 2)], [("a", 2), ("b", 1), ("c", 2)], [("b", 1), ("c", 2)]),
    ([("a", 1), ("b", 1), ("a", 1)], [("b", 2), ("a", 2)], [("b", 1)]),  # a grown layout
    ([("a", 2), ("b", 1)], [("a", 3)], None),                       # b's rank would go
    ([("a", 2)], [("a", 1), ("b", 2)], None),                       # one of a's would go
    ([("a", 2)], [("a", 2)], None),                                 # nothing added
])
def test_added_slots_are_those_beyond_the_running_ranks_when_none_of_theirs_goes(running, found,
                                                                                  added):
    assert added_slots(running, found) == added


def joining_of(offer):
    """The Joining that an offer's command hands the new ranks' wrapper."""
    command = offer.command
    assert command[:len(WRAPPER)] == WRAPPER and command[len(WRAPPER)] == offers.JOINED_FLAG
    return offers.read_joining(command[len(WRAPPER) + 1])


def test_an_offer_under_mpich_places_the_new_ranks_on_any_host_after_the_world():
    grower = Resizer(mpi.HYDRA, ["python", "train.py"], ["a"], local=False)
    offer = grower.growth(4, 5, [("a", 2), ("b", 1)], [("c", 2), ("a", 1)])
    assert offer.generation == 4
    # One place: Hydra keeps one host list for a whole spawn (a second "host" key replaced the
    # first, and every new rank went to the last host).
    assert offer.places == [offers.SpawnPlace(3, {"hosts": "c,c,a"})]
    assert offer.command[-3:] == ["--", "python", "train.py"]
    # hvdrun numbers the first new rank after the 5 the life started (one was killed under
    # --ulfm); in the world it comes after the 3 running ranks.
    assert joining_of(offer) == offers.Joining(5, 3, [("a", 2), ("b", 1), ("c", 2), ("a", 1)], 4)


def test_no_offer_where_the_new_ranks_could_not_reach_hvdrun_or_their_launcher():
    # hvdrun's ports listen on the loopback for a life all on this machine.
    assert Resizer(mpi.HYDRA, ["x"], [HERE], local=True).growth(1, 2, [(HERE, 2)], [("b", 1)]) is None
    assert Resizer(mpi.HYDRA, ["x"], [HERE], local=True).growth(1, 2, [(HERE, 2)], [(HERE, 1)])
    # Open MPI's mpirun passes its environment only to the ranks of its own host, and spawns
    # only on the hosts it was started with.
    open_mpi = Resizer(mpi.OPENMPI, ["x"], [HERE, "b"], local=False)
    assert open_mpi.growth(1, 2, [(HERE, 1), ("b", 1)], [("b", 1)]) is None
    assert Resizer(mpi.OPENMPI, ["x"], ["b"], local=False).growth(1, 1, [("b", 1)], [(HERE, 1)]) is None
    offer = open_mpi.growth(1, 2, [(HERE, 1), ("b", 1)], [(HERE, 2)])
    assert offer.places == [offers.SpawnPlace(2, {"host": HERE, "PMIX_MAPBY": "slot:OVERSUBSCRIBE"})]


def test_no_offer_that_would_not_fit_in_the_notice_answer():
    long_command = ["x" * (protocol.NOTICE_OFFER_BYTES // 2)] * 2
    assert Resizer(mpi.HYDRA, long_command, ["a"], local=False).growth(1, 1, [("a", 1)], [("a", 1)]) is None


def test_an_offer_and_a_joining_read_back_as_they_were_written():
    offer = offers.Growth(7, ["python", "-m", "w", "--", "t.py"],
                          [offers.SpawnPlace(1, {"host": "h"}), offers.SpawnPlace(3, {})])
    assert offers.read_offer(offers.offer_json(offer)) == offer
    removal = offers.Removal(8, [0, 2])
    assert offers.read_offer(offers.offer_json(removal)) == removal
    joining = offers.Joining(3, 2, [("h", 2), ("g", 1)], 7)
    assert offers.read_joining(offers.joining_json(joining)) == joining


@pytest.mark.parametrize("changed", [
    {"generation": -1}, {"generation": True}, {"command": []}, {"command": ["x", 3]},
    {"places": []}, {"places": [[0, {}]]}, {"places": [[1, {"host": 2}]]}, {"places": [[1]]},
    {"extra": 1},
])
def test_a_malformed_growth_offer_is_refused_naming_what(changed):
    fields = {"generation": 1, "command": ["x"], "places": [[1, {"host": "h"}]], **changed}
    with pytest.raises(ValueError, match="growth offer"):
        offers.read_offer(json.dumps(fields).encode())


@pytest.mark.parametrize("data", [b'{"generation": 1, "leaving": []}',
                                  b'{"generation": 1, "leaving": [-1]}',
                                  b'{"generation": 1, "leaving": [1], "command": ["x"]}'])
def test_a_malformed_removal_offer_is_refused(data):
    with pytest.raises(ValueError, match="removal offer"):
        offers.read_offer(data)


@pytest.mark.parametrize("text", ['{"first": 1}', "not json", '{"first": 1, "world_first": 0, '
                                  '"world": [["h", 0]], "generation": 1}'])
def test_a_malformed_joining_is_refused(text):
    with pytest.raises(ValueError, match=offers.JOINED_FLAG):
        offers.read_joining(text)


def ask(generation):
    with socket.create_connection(("127.0.0.1", generation.port), timeout=10) as conn:
        return protocol.ask_notice(conn, SECRET)


def test_the_notice_answer_carries_the_offer_with_its_generation():
    generation = Generation(SECRET)
    try:
        assert ask(generation) == protocol.Notice(0, b"")
        generation.changed(b'{"an": "offer"}')
        assert ask(generation) == protocol.Notice(1, b'{"an": "offer"}')
        generation.changed()  # a restart: no offer
        assert ask(generation) == protocol.Notice(2, b"")
    finally:
        generation.close()


def test_an_offer_changed_on_its_way_is_refused():
    server = socket.create_server(("127.0.0.1", 0))

    def tamper():
        conn, _ = server.accept()
        with conn:
            challenge = protocol.notice_challenge()
            conn.sendall(challenge)
            question = protocol.receive(conn, protocol.NOTICE_QUESTION_BYTES, None)
            reply = protocol.notice_reply(SECRET, challenge, question, 1, b'{"a": 1}')
            conn.sendall(reply.data.replace(b'{"a": 1}', b'{"a": 2}'))

    threading.Thread(target=tamper, daemon=True).start()
    try:
        with socket.create_connection(server.getsockname(), timeout=10) as conn:
            with pytest.raises(ValueError, match="not signed"):
                protocol.ask_notice(conn, SECRET)
    finally:
        server.close()


def test_the_watcher_offers_a_growth_and_takes_the_new_ranks_in_once_they_start(capsys):
    layout = [(HERE, 2)]
    relay = ElasticRelay(2, True, None, layout)
    relay.started.update({0, 1})
    hosts = Hosts([(HERE, 3)])
    watch = watcher.HostWatcher(hosts, Blacklist(None), list(layout), None, GenerationCount(), relay,
                                resizer=Resizer(mpi.HYDRA, ["t.py"], [HERE], local=True))
    watch.check_hosts()
    offer = offers.read_offer(watch.generation.offer)
    assert watch.generation.number == 1 and offer.places == [offers.SpawnPlace(1, {"hosts": HERE})]
    assert "grow the job in place onto localhost:1" in capsys.readouterr().err
    watch.check_resized()
    assert watch.started_on == layout and watch.raised  # nothing started yet
    relay.deliver(protocol.Started(2, "thishost"))
    assert relay.np == 3
    watch.check_resized()
    assert watch.started_on == [(HERE, 2), (HERE, 1)] and not watch.raised
    watch.check_hosts()  # the same hosts: nothing more
    assert watch.generation.number == 1


@pytest.mark.parametrize("resizer, found", [
    (None, [(HERE, 3)]),                                                  # turned off
    (Resizer(mpi.HYDRA, ["t.py"], [HERE, "b"], local=False), [(HERE, 1), ("c", 1)]),  # both
    (Resizer(mpi.OPENMPI, ["t.py"], [HERE, "b"], local=False), [(HERE, 1)]),  # finalize waits
    (Resizer(mpi.HYDRA, ["t.py"], [HERE, "b"], local=False, min_np=2), [(HERE, 1)]),
    (Resizer(mpi.HYDRA, ["t.py"], [HERE, "b"], local=False), [(HERE, 1)]),  # b elsewhere
])
def test_where_no_change_can_be_in_place_the_watcher_asks_for_a_restart(resizer, found):
    relay = ElasticRelay(2, True, None, [(HERE, 1), ("b", 1)])
    watch = watcher.HostWatcher(Hosts(found), Blacklist(None), [(HERE, 1), ("b", 1)], None,
                                GenerationCount(), relay, resizer=resizer)
    watch.check_hosts()
    assert watch.generation.number == 1 and watch.generation.offer == b""
    assert watch.growing is None and relay.expected is None and watch.leaving == []


@pytest.mark.parametrize("running, found, leaving", [
    ([("a", 3)], [("a", 1)], [1, 2]),                     # the last ones of the host
    ([("a", 2), ("b", 1), ("a", 1)], [("a", 2), ("b", 1)], [3]),
    ([("a", 1), ("b", 2)], [("b", 1)], [0, 2]),
    ([("a", 2)], [("a", 2)], None),                       # nothing dropped
    ([("a", 2)], [("a", 1), ("b", 1)], None),             # a slot added
])
def test_removed_places_are_the_last_ranks_of_each_host_that_lost_slots(running, found, leaving):
    assert removed_places(running, found) == leaving


def test_the_watcher_offers_a_removal_and_drops_the_ranks_once_they_have_exited(capsys):
    a, b = HERE, "127.0.0.1"  # two names of this machine: removals are in place only here
    layout = [(a, 2), (b, 1)]
    relay = ElasticRelay(3, False, None, layout)
    relay.started.update({0, 1, 2})
    watch = watcher.HostWatcher(Hosts([(a, 1), (b, 1)]), Blacklist(None), list(layout),
                                None, GenerationCount(), relay,
                                resizer=Resizer(mpi.HYDRA, ["t.py"], [a, b], local=True))
    watch.check_hosts()
    assert offers.read_offer(watch.generation.offer) == offers.Removal(1, [1])
    assert f"at their next commit rank 1 on {a} leave the job" in capsys.readouterr().err
    relay.deliver(protocol.Exited(0, 0, 1.0))  # not a leaving rank
    watch.check_resized()
    assert watch.raised
    relay.deliver(protocol.Exited(1, 0, 1.0))
    watch.check_resized()
    assert watch.layout == [(a, 1), (b, 1)] and watch.left == {1} and not watch.raised
    # A later growth onto a numbers its new rank after the three the life started, and puts it
    # after the two ranks left in the world.
    watch.discovery.now = [(a, 2), (b, 1)]
    watch.check_hosts()
    joining = joining_of(offers.read_offer(watch.generation.offer))
    assert joining.first == 3 and joining.world_first == 2


def test_the_relay_names_a_new_rank_s_host_and_counts_it_once_it_starts():
    relay = ElasticRelay(2, True, None, [("a", 2)])
    relay.expect([("b", 1)])
    relay.deliver(protocol.Started(1, "a"))  # a rank of the life's start changes nothing
    assert relay.np == 2
    relay.deliver(protocol.Started(2, "b"))
    assert relay.np == 3 and relay.where([2]) == " on b" and relay.expected is None


def test_a_new_rank_s_horovod_variables_count_the_ranks_before_it_on_its_host():
    # The world after growing [a:2, b:1] by a:1 and b:1: ranks 3 (a) and 4 (b) are new.
    world = [("a", 2), ("b", 1), ("a", 1), ("b", 1)]
    assert wrapper.horovod_variables(world, 3) == {
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "5", "HOROVOD_LOCAL_RANK": "2",
        "HOROVOD_LOCAL_SIZE": "3", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": "a"}
    assert wrapper.horovod_variables(world, 4)["HOROVOD_LOCAL_RANK"] == "1"
    assert wrapper.horovod_variables(world, 4)["HOROVOD_CROSS_RANK"] == "1"  # after rank 1


def test_a_wrapper_told_a_malformed_place_exits_with_2_before_it_runs_anything(capsys):
    assert wrapper.main([offers.JOINED_FLAG, "{}", "--", "true"]) == 2
    assert offers.JOINED_FLAG in capsys.readouterr().err


def test_the_ranks_read_hvdrun_s_offer_from_the_notice(monkeypatch):
    from hvd_trainer import elastic
    state = elastic.ObjectState(step=0)
    offer = offers.Growth(2, ["w"], [offers.SpawnPlace(1, {"host": HERE})])
    with pytest.raises(elastic.HostsUpdatedInterrupt) as raised:
        state._check(protocol.Notice(2, offers.offer_json(offer)))
    assert raised.value.offer == offer
    removal = offers.Removal(3, [1])
    with pytest.raises(elastic.HostsUpdatedInterrupt) as raised:
        state._check(protocol.Notice(3, offers.offer_json(removal)))
    assert raised.value.offer == removal
    with pytest.raises(elastic.HostsUpdatedInterrupt) as raised:
        state._check(protocol.Notice(2, b""))
    assert raised.value.offer is None


def test_a_life_grown_in_place_counts_against_its_host_once():
    """A grown layout names a host twice (h:2, then h:1): one failed life is one life in a
    row for h, not two (which would leave it out at once)."""
    from types import SimpleNamespace
    from hvd_trainer_launch.elastic import driver
    job = SimpleNamespace(args=SimpleNamespace(reset_limit=None, blacklist_cooldown_range=None),
                          blacklist=Blacklist(None), min_np=1)
    lives = driver._Lives()
    for life in (1, 2):
        relay = ElasticRelay(3, True, None, [("h", 2), ("h", 1)])
        relay.started.update({0, 1, 2})
        relay.record(2, 1, "exited with code")
        relay.settle()
        assert driver._after(job, lives, driver._Life([("h", 2), ("h", 1)], relay, 1)) is None
        assert job.blacklist.usable([("h", 3)]) == ([("h", 3)] if life == 1 else [])


def test_a_change_in_place_counts_against_the_reset_limit_as_a_restart():
    """As in Horovod, every reset counts: with none left, the ranks leave instead, and the
    restart ends the job naming --reset-limit (driver._after)."""
    for left, offered in ((1, True), (0, False)):
        relay = ElasticRelay(2, True, None, [(HERE, 2)])
        watch = watcher.HostWatcher(Hosts([(HERE, 3)]), Blacklist(None), [(HERE, 2)], None,
                                    GenerationCount(), relay, resets_left=left,
                                    resizer=Resizer(mpi.HYDRA, ["t.py"], [HERE], local=True))
        watch.check_hosts()
        assert (watch.generation.offer != b"") == offered and watch.in_place == int(offered)


def test_a_growth_whose_command_names_leaving_reads_back_as_a_growth():
    offer = offers.Growth(1, ["python", "t.py", "leaving"], [offers.SpawnPlace(1, {})])
    assert offers.read_offer(offers.offer_json(offer)) == offer
