"""hvd_trainer.spark.run_elastic's pieces that need no Spark: its arguments checked as
Horovod's (defaults, aliases, refusals naming the argument), the hosts and agents that linked
tasks make, and the waits before a failed slot is asked for again."""
import warnings

import pytest

from hvd_trainer_launch.engines import agent_link, spark_agents, spark_elastic
from hvd_trainer_launch.engines.spark_elastic import ElasticArguments


def _check(parallelism=4, **given):
    arguments = dict(num_proc=None, min_num_proc=None, max_num_proc=None, start_timeout=None,
                     elastic_timeout=None, reset_limit=None, env=None, verbose=1, nics=None,
                     prefix_output_with_timestamp=False)
    arguments.update(given)
    return spark_elastic.check_arguments(parallelism=parallelism, **arguments)


def test_defaults_are_horovods(monkeypatch):
    monkeypatch.delenv(spark_elastic.START_TIMEOUT_VARIABLE, raising=False)
    monkeypatch.delenv(spark_elastic.ELASTIC_TIMEOUT_VARIABLE, raising=False)
    assert _check() == ElasticArguments(4, 4, 4, 600.0, 600.0, None, {}, [], False, False)
    assert _check(num_proc=2, max_num_proc=5) == ElasticArguments(2, 2, 5, 600.0, 600.0, None,
                                                                  {}, [], False, False)
    monkeypatch.setenv(spark_elastic.START_TIMEOUT_VARIABLE, "30")
    monkeypatch.setenv(spark_elastic.ELASTIC_TIMEOUT_VARIABLE, "7.5")
    found = _check(num_proc=3, min_num_proc=1, reset_limit=0, env={"A": 1}, verbose=2,
                   nics={"eth1", "eth0"}, prefix_output_with_timestamp=True)
    assert found == ElasticArguments(3, 1, 3, 30.0, 7.5, 0, {"A": "1"}, ["eth0", "eth1"], True,
                                     True)


def test_deprecated_aliases_warn_and_count():
    with pytest.warns(DeprecationWarning, match="min_np is deprecated, use min_num_proc"):
        assert _check(num_proc=3, min_np=2).min_num_proc == 2
    with pytest.warns(DeprecationWarning, match="max_np is deprecated, use max_num_proc"):
        assert _check(num_proc=3, max_np=6).max_num_proc == 6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="give min_num_proc or the deprecated min_np, "
                                             "not both"):
            _check(min_num_proc=1, min_np=1)


@pytest.mark.parametrize("given, match", [
    (dict(num_proc=0), r"num_proc=0 must be an int >= 1"),
    (dict(num_proc=True), r"num_proc=True must be an int >= 1"),
    (dict(min_num_proc="1"), r"min_num_proc='1' must be an int >= 1"),
    (dict(max_num_proc=2.0), r"max_num_proc=2.0 must be an int >= 1"),
    (dict(num_proc=3, min_num_proc=4), r"min_num_proc=4 <= num_proc=3 <= max_num_proc=3 does "
                                       r"not hold"),
    (dict(num_proc=3, max_num_proc=2), r"min_num_proc=3 <= num_proc=3 <= max_num_proc=2"),
    (dict(start_timeout=0), r"start_timeout=0 must be a number of seconds > 0"),
    (dict(elastic_timeout="5"), r"elastic_timeout='5' must be a number of seconds > 0"),
    (dict(reset_limit=-1), r"reset_limit=-1 must be None or an int >= 0"),
    (dict(reset_limit=1.5), r"reset_limit=1.5 must be None or an int >= 0"),
    (dict(nics="eth0"), r"nics='eth0' must be a list \(or set\) of network interface names"),
    (dict(verbose="2"), r"verbose='2' must be an int"),
    (dict(env={"A B": "1"}), r"env: "),
])
def test_refusals_name_the_argument(given, match):
    with pytest.raises(ValueError, match=r"hvd_trainer\.spark\.run_elastic: " + match):
        _check(**given)


def test_a_timeout_variable_that_is_not_a_number_is_named(monkeypatch):
    monkeypatch.setenv(spark_elastic.ELASTIC_TIMEOUT_VARIABLE, "soon")
    with pytest.raises(ValueError, match=r"\$HOROVOD_ELASTIC_TIMEOUT='soon' is not a number"):
        _check()
    monkeypatch.setenv(spark_elastic.ELASTIC_TIMEOUT_VARIABLE, "-1")
    with pytest.raises(ValueError, match=r"\$HOROVOD_ELASTIC_TIMEOUT=-1.0 must be a number of "
                                         r"seconds > 0"):
        _check()


def test_retry_waits_grow_and_stop_at_the_most():
    assert spark_agents.retry_wait(0) == 0
    assert spark_agents.retry_wait(1) == spark_agents.RETRY_FIRST_SECONDS
    assert spark_agents.retry_wait(2) == 2 * spark_agents.RETRY_FIRST_SECONDS
    assert spark_agents.retry_wait(60) == spark_agents.RETRY_MOST_SECONDS


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [3, 2, 0, 1]])
def test_executors_in_order_of_their_lowest_slot_named_by_host(slots):
    where = {0: ("h1", "10"), 1: ("h2", "20"), 2: ("h1", "10"), 3: ("h1", "11")}
    hellos = [agent_link.Hello(slot, f"t{slot}", *where[slot], {"gpu": [str(slot)]})
              for slot in slots]
    by_slot = {hello.slot: hello for hello in hellos}
    names, chosen = {}, {}
    found = spark_agents.executors_of(hellos, names, chosen)
    # Two executors on h1: the second is h1/2; each executor's agent is its lowest slot.
    assert found == [spark_agents.Executor("h1", "h1", 2, by_slot[0]),
                     spark_agents.Executor("h2", "h2", 1, by_slot[1]),
                     spark_agents.Executor("h1/2", "h1", 1, by_slot[3])]
    assert spark_agents.resources_in_slot_order(hellos, found[0]) == [{"gpu": ["0"]},
                                                                      {"gpu": ["2"]}]
    # h1's first executor goes: the other keeps its name, and a new one on h1 takes h1's.
    left = [by_slot[1], by_slot[3]]
    assert [e.name for e in spark_agents.executors_of(left, names, chosen)] == ["h2", "h1/2"]
    new = agent_link.Hello(4, "t4", "h1", "12", {})
    assert [e.name for e in spark_agents.executors_of(left + [new], names, chosen)] == \
        ["h2", "h1/2", "h1"]


def test_an_executors_agent_stays_while_it_lives():
    # Its commits live with it: a task with a lower slot that comes later does not take over.
    late, first = agent_link.Hello(0, "late", "h1", "10", {}), \
        agent_link.Hello(1, "first", "h1", "10", {})
    names, chosen = {}, {}
    assert spark_agents.executors_of([first], names, chosen)[0].agent == first
    assert spark_agents.executors_of([late, first], names, chosen)[0].agent == first
    # Gone, it is followed by the lowest slot's task.
    assert spark_agents.executors_of([late], names, chosen)[0].agent == late
