"""Growing an elastic job in place, the parts that need no MPI job: which host changes hvdrun
grows a life into (elastic/growing.py) and its offer, the offer's and the new rank's formats
(growth.py) and their signature, the watcher and the relay taking the new ranks in, the new
rank's Horovod variables, and the ranks reading the offer. The growth itself runs under MPICH
and Open MPI in tests/parallel (test_elastic.py, test_torch_elastic.py, test_ulfm.py)."""
import json
import socket
import threading

import pytest

from hvd_trainer_launch import growth, mpi, protocol
from hvd_trainer_launch.elastic import watcher
from hvd_trainer_launch.elastic.growing import WRAPPER, Grower, added_slots
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
    assert command[:len(WRAPPER)] == WRAPPER and command[len(WRAPPER)] == growth.JOINED_FLAG
    return growth.read_joining(command[len(WRAPPER) + 1])


def test_an_offer_under_mpich_places_the_new_ranks_on_any_host_after_the_world():
    grower = Grower(mpi.HYDRA, ["python", "train.py"], ["a"], local=False)
    offer = grower.offer(4, 5, [("a", 2), ("b", 1)], [("c", 2), ("a", 1)])
    assert offer.generation == 4
    assert offer.places == [growth.SpawnPlace(2, {"host": "c"}), growth.SpawnPlace(1, {"host": "a"})]
    assert offer.command[-3:] == ["--", "python", "train.py"]
    # hvdrun numbers the first new rank after the 5 the life started (one was killed under
    # --ulfm); in the world it comes after the 3 running ranks.
    assert joining_of(offer) == growth.Joining(5, 3, [("a", 2), ("b", 1), ("c", 2), ("a", 1)], 4)


def test_no_offer_where_the_new_ranks_could_not_reach_hvdrun_or_their_launcher():
    # hvdrun's ports listen on the loopback for a life all on this machine.
    assert Grower(mpi.HYDRA, ["x"], [HERE], local=True).offer(1, 2, [(HERE, 2)], [("b", 1)]) is None
    assert Grower(mpi.HYDRA, ["x"], [HERE], local=True).offer(1, 2, [(HERE, 2)], [(HERE, 1)])
    # Open MPI's mpirun passes its environment only to the ranks of its own host, and spawns
    # only on the hosts it was started with.
    open_mpi = Grower(mpi.OPENMPI, ["x"], [HERE, "b"], local=False)
    assert open_mpi.offer(1, 2, [(HERE, 1), ("b", 1)], [("b", 1)]) is None
    assert Grower(mpi.OPENMPI, ["x"], ["b"], local=False).offer(1, 1, [("b", 1)], [(HERE, 1)]) is None
    offer = open_mpi.offer(1, 2, [(HERE, 1), ("b", 1)], [(HERE, 2)])
    assert offer.places == [growth.SpawnPlace(2, {"host": HERE, "PMIX_MAPBY": "slot:OVERSUBSCRIBE"})]


def test_no_offer_that_would_not_fit_in_the_notice_answer():
    long_command = ["x" * (protocol.NOTICE_OFFER_BYTES // 2)] * 2
    assert Grower(mpi.HYDRA, long_command, ["a"], local=False).offer(1, 1, [("a", 1)], [("a", 1)]) is None


def test_an_offer_and_a_joining_read_back_as_they_were_written():
    offer = growth.Growth(7, ["python", "-m", "w", "--", "t.py"],
                          [growth.SpawnPlace(1, {"host": "h"}), growth.SpawnPlace(3, {})])
    assert growth.read_growth(growth.growth_json(offer)) == offer
    joining = growth.Joining(3, 2, [("h", 2), ("g", 1)], 7)
    assert growth.read_joining(growth.joining_json(joining)) == joining


@pytest.mark.parametrize("changed", [
    {"generation": -1}, {"generation": True}, {"command": []}, {"command": ["x", 3]},
    {"places": []}, {"places": [[0, {}]]}, {"places": [[1, {"host": 2}]]}, {"places": [[1]]},
    {"extra": 1},
])
def test_a_malformed_offer_is_refused_naming_what(changed):
    fields = {"generation": 1, "command": ["x"], "places": [[1, {"host": "h"}]], **changed}
    with pytest.raises(ValueError, match="growth offer"):
        growth.read_growth(json.dumps(fields).encode())


@pytest.mark.parametrize("text", ['{"first": 1}', "not json", '{"first": 1, "world_first": 0, '
                                  '"world": [["h", 0]], "generation": 1}'])
def test_a_malformed_joining_is_refused(text):
    with pytest.raises(ValueError, match=growth.JOINED_FLAG):
        growth.read_joining(text)


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
                                grower=Grower(mpi.HYDRA, ["t.py"], [HERE], local=True))
    watch.check_hosts()
    offer = growth.read_growth(watch.generation.growth)
    assert watch.generation.number == 1 and offer.places == [growth.SpawnPlace(1, {"host": HERE})]
    assert "grow the job in place onto localhost:1" in capsys.readouterr().err
    watch.check_grown()
    assert watch.started_on == layout and watch.raised  # nothing started yet
    relay.deliver(protocol.Started(2, "thishost"))
    assert relay.np == 3
    watch.check_grown()
    assert watch.started_on == [(HERE, 2), (HERE, 1)] and not watch.raised
    watch.check_hosts()  # the same hosts: nothing more
    assert watch.generation.number == 1


def test_without_a_grower_or_with_a_rank_going_the_watcher_asks_for_a_restart():
    for grower, found in ((None, [(HERE, 3)]),
                          (Grower(mpi.HYDRA, ["t.py"], [HERE], local=True), [(HERE, 1)])):
        relay = ElasticRelay(2, True, None, [(HERE, 2)])
        watch = watcher.HostWatcher(Hosts(found), Blacklist(None), [(HERE, 2)], None,
                                    GenerationCount(), relay, grower=grower)
        watch.check_hosts()
        assert watch.generation.number == 1 and watch.generation.growth == b""
        assert watch.growing is None and relay.expected is None


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
    assert wrapper.main([growth.JOINED_FLAG, "{}", "--", "true"]) == 2
    assert growth.JOINED_FLAG in capsys.readouterr().err


def test_the_ranks_read_hvdrun_s_offer_from_the_notice(monkeypatch):
    from hvd_trainer import elastic
    state = elastic.ObjectState(step=0)
    offer = growth.Growth(2, ["w"], [growth.SpawnPlace(1, {"host": HERE})])
    with pytest.raises(elastic.HostsUpdatedInterrupt) as raised:
        state._check(protocol.Notice(2, growth.growth_json(offer)))
    assert raised.value.growth == offer
    with pytest.raises(elastic.HostsUpdatedInterrupt) as raised:
        state._check(protocol.Notice(2, b""))
    assert raised.value.growth is None
