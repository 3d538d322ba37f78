"""hvdrun's elastic mode, its parts: discovery output, rank layout, blacklist, flag checks,
the failures a life counts, and the notice port's address and authentication."""
import argparse
import socket
import threading

import pytest

from hvd_trainer import elastic as core
from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.cli import hvdrun
from hvd_trainer_launch.elastic import discovery, driver as elastic, notices, registration
from hvd_trainer_launch.job import flags
from hvd_trainer_launch.job.relay import ENDED


def test_discovery_lines_take_slots_per_host_when_they_give_none():
    text = "a:2\nb\n\n  c:1  \n"
    assert discovery.parse_discovered(text, 4) == [("a", 2), ("b", 4), ("c", 1)]
    assert discovery.parse_discovered("b\n", None) == [("b", 1)]
    with pytest.raises(ValueError, match="bad host entry 'a:x'"):
        discovery.parse_discovered("a:x\n", None)


def test_ranks_fill_the_hosts_in_order():
    layout = discovery.allocate([("a", 2), ("b", 3), ("c", 4)], 4)
    assert layout == [("a", 2), ("b", 2)]
    assert [discovery.host_of(layout, rank) for rank in range(4)] == ["a", "a", "b", "b"]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_life_that_failed_on_a_host_maybe_as_a_consequence_keeps_its_row():
    # b failed in the second life too, but after a's failure: no count, and no break.
    blacklist = registration.Blacklist(None, Clock())
    assert blacklist.life_ended(["a", "b"], {"b"}) == []
    assert blacklist.life_ended(["a", "b"], {"a"}, unsure={"b"}) == []
    assert blacklist.life_ended(["a", "b"], {"b"}) == ["b"]


def test_a_host_failing_in_two_lives_in_a_row_is_out_for_the_cooldown():
    clock = Clock()
    blacklist = registration.Blacklist((5.0, 5.0), clock)
    hosts = [("a", 2), ("b", 2)]
    assert blacklist.life_ended(["a", "b"], {"a"}) == []
    assert blacklist.life_ended(["a", "b"], set()) == []  # a good life in between
    assert blacklist.life_ended(["a", "b"], {"a"}) == []
    assert blacklist.life_ended(["a", "b"], {"a"}) == ["a"]
    assert blacklist.usable(hosts) == [("b", 2)] and blacklist.will_return()
    clock.now += 5.0
    assert blacklist.usable(hosts) == hosts


def test_without_a_cooldown_a_failing_host_stays_out():
    clock = Clock()
    blacklist = registration.Blacklist(None, clock)
    blacklist.life_ended(["a"], {"a"})
    blacklist.life_ended(["a"], {"a"})
    clock.now += 1e9
    assert blacklist.usable([("a", 1)]) == [] and not blacklist.will_return()


def parse(*argv):
    return hvdrun.build_parser().parse_args([*argv, "python", "train.py"])


@pytest.mark.parametrize("argv, message", [
    (["--min-np", "3", "--max-np", "2"], "--max-np 2 is below --min-np 3"),
    (["-np", "5", "--min-np", "2", "--max-np", "4"], "-np 5 must lie between"),
    (["--min-np", "0"], "--min-np must be >= 1"),
    (["--host-discovery-script", "d.sh", "-H", "a:2"], "either --host-discovery-script or -H"),
    (["--min-np", "1", "--blacklist-cooldown-range", "5", "2"], "0 <= MIN <= MAX"),
    (["--min-np", "1", "--elastic-timeout", "0"], "--elastic-timeout must be > 0"),
    (["--min-np", "1", "--reset-limit", "-1"], "--reset-limit must be >= 0"),
    (["--min-np", "2", "--ulfm"], "--ulfm needs Open MPI 5's mpirun .* MPICH"),
])
def test_bad_elastic_flags_are_named(argv, message):
    args = parse(*argv)
    assert elastic.requested(args)
    with pytest.raises(ValueError, match=message):
        elastic.check(args, mpi.HYDRA)


def test_ulfm_asks_open_mpi_for_its_fault_tolerance():
    args = parse("--min-np", "2", "--ulfm")
    elastic.check(args, mpi.OPENMPI)
    assert flags.launcher_arguments(args, mpi.OPENMPI)[-2:] == ["--with-ft", "ulfm"]
    assert "--with-ft" not in flags.launcher_arguments(parse("--min-np", "2"), mpi.OPENMPI)


@pytest.mark.parametrize("flag", ["--ulfm", "--elastic-allow-fresh-start"])
def test_an_elastic_mode_flag_without_elastic_mode_is_refused_not_ignored(flag, capsys):
    with pytest.raises(SystemExit) as end:
        hvdrun.main(["-np", "2", flag, "python", "train.py"])
    assert end.value.code == 2
    assert f"{flag} is an elastic-mode flag: give --min-np" in capsys.readouterr().err


def test_plain_flags_are_not_elastic():
    assert not elastic.requested(parse("-np", "2"))
    assert isinstance(parse("-np", "2"), argparse.Namespace)


SECRET = b"the job's secret"


def test_the_notice_port_listens_on_the_loopback_when_every_rank_runs_here():
    generation = notices.Generation(SECRET)
    try:
        address = generation.address([("localhost", 2), ("127.0.0.1", 2)])
        assert generation.server.listener.getsockname() == ("127.0.0.1", generation.port)
        assert address == f"127.0.0.1:{generation.port}"
    finally:
        generation.close()


def test_the_notice_port_listens_on_the_chosen_interface_for_other_hosts():
    generation = notices.Generation(SECRET, nics=["lo"])
    try:
        address = generation.address([("node-a", 2), ("node-b", 2)])
        assert generation.server.listener.getsockname()[0] == "127.0.0.1"  # lo's address
        assert address == f"127.0.0.1:{generation.port}"
    finally:
        generation.close()
    with pytest.raises(ValueError, match="--network-interface no-such-nic0: no IPv4 address"):
        notices.interface_address("no-such-nic0")


def test_the_notice_port_tells_only_the_holder_of_the_secret():
    generation = notices.Generation(SECRET)
    generation.number = 3
    try:
        with socket.create_connection(("127.0.0.1", generation.port), timeout=10) as conn:
            assert protocol.ask_notice(conn, SECRET) == protocol.Notice(3, b"")
        # A peer without the secret: its answer to the challenge is wrong, and it is told
        # nothing (the connection closes), so ask_notice cannot read a number either.
        with socket.create_connection(("127.0.0.1", generation.port), timeout=10) as conn:
            with pytest.raises(ConnectionError):
                protocol.ask_notice(conn, b"a guess")
    finally:
        generation.close()


def test_a_rank_ignores_a_notice_that_hvdrun_did_not_sign(monkeypatch, caplog):
    """A process on the port that answers a plain generation number (what hvdrun once sent)
    cannot make the job restart."""
    server = socket.create_server(("127.0.0.1", 0))

    def forge():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"5" * 64)

    threading.Thread(target=forge, daemon=True).start()
    monkeypatch.setenv(protocol.NOTIFY_VARIABLE, f"127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv(protocol.GENERATION_VARIABLE, "0")
    monkeypatch.setenv(protocol.SECRET_VARIABLE, SECRET.decode())
    try:
        assert not core.ObjectState(step=0)._notices.changed()
    finally:
        server.close()
    assert any("not signed with this job's secret" in r.getMessage() for r in caplog.records)


def test_a_life_counts_every_rank_that_failed_before_hvdrun_began_to_end_it():
    relay = registration.ElasticRelay(4, False, None)
    relay.record(2, 1, "exited with code")
    relay.record(0, 3, "exited with code")
    relay.record(1, protocol.RESET_EXIT_CODE, "exited with code")  # left for new hosts
    relay.record(3, 143, ENDED)  # mpiexec ended it (Open MPI does, after a failure)
    relay.ending = True  # what run_job sets when it ends the life
    relay.record(3, 143, "exited with code")  # a consequence of the ending
    assert relay.failed == {2: 1, 0: 3}
    assert (relay.settle().rank, relay.failure.code) == (2, 1)  # the earliest exit
    layout = [("a", 2), ("b", 2)]
    assert {discovery.host_of(layout, rank) for rank in relay.failed} == {"a", "b"}


def test_a_life_counts_against_the_host_of_its_first_own_failure_by_exit_time():
    # Rank 3 on b was killed first; rank 1 on a failed after it, its peer gone; rank 0 was
    # ended by the launcher even earlier, which is no failure of its own.
    relay = registration.ElasticRelay(4, False, None)
    relay.record(1, 1, "exited with code", at=20.5)
    relay.record(0, 143, ENDED, at=19.0)
    relay.record(3, 137, "exited with code", at=20.1)
    assert relay.blamed([("a", 2), ("b", 2)]) == {"b"}


def test_a_life_counts_against_the_host_of_a_killed_rank_seen_just_after_a_survivors_abort():
    # As hvdrun names the first failure: rank 3 on b was killed (-9), but its wrapper saw it
    # 3 ms after rank 1's MPI on a had aborted on the lost connection.
    relay = registration.ElasticRelay(4, False, None)
    relay.record(1, 14, "exited with code", at=20.100)
    relay.record(3, 137, "exited with code", at=20.103, killed=True)
    assert relay.blamed([("a", 2), ("b", 2)]) == {"b"}


def test_a_life_whose_launch_failed_counts_against_the_hosts_that_started_nothing():
    # No rank failed on its own; ranks 2 and 3 (on b and c) never started: ssh could not reach
    # their hosts. Rank 1, here, did not start either, but only as the launch was dropped.
    relay = registration.ElasticRelay(4, False, None)
    relay.started.add(0)
    layout = [("localhost", 2), ("b", 1), ("c", 1)]
    assert relay.blamed(layout) == {"b", "c"}
    assert registration.ElasticRelay(2, False, None).blamed([("localhost", 2)]) == {"localhost"}
