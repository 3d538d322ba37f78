"""hvdrun's elastic mode, its parts: discovery output, rank layout, blacklist, flag checks."""
import argparse

import pytest

from hvd_trainer_launch import elastic, hvdrun


def test_discovery_lines_take_slots_per_host_when_they_give_none():
    text = "a:2\nb\n\n  c:1  \n"
    assert elastic.parse_discovered(text, 4) == [("a", 2), ("b", 4), ("c", 1)]
    assert elastic.parse_discovered("b\n", None) == [("b", 1)]
    with pytest.raises(ValueError, match="bad host entry 'a:x'"):
        elastic.parse_discovered("a:x\n", None)


def test_ranks_fill_the_hosts_in_order():
    layout = elastic.allocate([("a", 2), ("b", 3), ("c", 4)], 4)
    assert layout == [("a", 2), ("b", 2)]
    assert [elastic.host_of(layout, rank) for rank in range(4)] == ["a", "a", "b", "b"]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_host_failing_in_two_lives_in_a_row_is_out_for_the_cooldown():
    clock = Clock()
    blacklist = elastic.Blacklist((5.0, 5.0), clock)
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
    blacklist = elastic.Blacklist(None, clock)
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
])
def test_bad_elastic_flags_are_named(argv, message):
    args = parse(*argv)
    assert elastic.requested(args)
    with pytest.raises(ValueError, match=message):
        elastic.check(args)


def test_plain_flags_are_not_elastic():
    assert not elastic.requested(parse("-np", "2"))
    assert isinstance(parse("-np", "2"), argparse.Namespace)
