"""The elastic engine job's pure parts: hvdrun's flags from the settings, and hvdrun's life
line (what the engine launch reads before each life's proxy lines)."""
import pytest

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import elastic


def test_hvdrun_flags_of_the_settings():
    assert elastic.hvdrun_flags(elastic.ElasticSettings(), "/d") == [
        "--min-np", "1", "--host-discovery-script", "/d", "--elastic-timeout", "600"]
    settings = elastic.ElasticSettings(min_np=2, max_np=4, np=3, reset_limit=5,
                                       elastic_timeout=7.5, cooldown_range=(1.0, 2.5),
                                       nics=("eth0", "eth1"), ulfm=True,
                                       hvdrun_args=("--prefix-output-with-timestamp",))
    assert elastic.hvdrun_flags(settings, "/d") == [
        "--min-np", "2", "--host-discovery-script", "/d", "--elastic-timeout", "7.5",
        "--max-np", "4", "-np", "3", "--reset-limit", "5",
        "--blacklist-cooldown-range", "1", "2.5", "--network-interfaces", "eth0,eth1",
        "--ulfm", "--prefix-output-with-timestamp"]


def test_a_life_line_reads_back():
    life = protocol.EngineLife(3, [("hvd-agent0-a", 2), ("hvd-agent4-b", 1)])
    line = protocol.life_line(life)
    assert line.startswith(protocol.ENGINE_LIFE_PREFIX) and "\n" not in line
    assert protocol.parse_life_line(line) == life


@pytest.mark.parametrize("text", ["{", '{"number": 1}', '{"number": "x", "hosts": []}',
                                  '{"number": 1, "hosts": [["a"]]}'])
def test_a_damaged_life_line_is_refused(text):
    with pytest.raises(ValueError, match="not a life line"):
        protocol.parse_life_line(protocol.ENGINE_LIFE_PREFIX + text)


def test_a_host_without_slots_is_refused():
    job = elastic.ElasticJob(b"", flavour="hydra", settings=elastic.ElasticSettings(),
                             serve=lambda dispatch: None)
    with pytest.raises(ValueError, match="has 0 slots; give 1 or more"):
        job.joined("a", 0)
    job.joined("a", 2)
    job.joined("b", 1)
    job.left("a")
    assert job.hosts() == {"b": 1}


def test_a_host_added_at_max_np_leaves_the_layout_as_it_is():
    from hvd_trainer_launch.elastic.watcher import layout_of
    life = layout_of([("a", 2)], 2)
    assert life == [("a", 2)]
    assert layout_of([("a", 2), ("b", 1), ("c", 1)], 2) == life  # no restart for b, c
    assert layout_of([("a", 2), ("b", 1)], 3) == [("a", 2), ("b", 1)]  # below max: grows
    assert layout_of([("b", 1), ("a", 2)], None) == [("b", 1), ("a", 2)]


def test_ray_logger_outside_an_elastic_ray_job_says_so(monkeypatch):
    from hvd_trainer.ray import ray_logger
    monkeypatch.delenv(protocol.ENGINE_EVENTS_VARIABLE, raising=False)
    with pytest.raises(RuntimeError, match="not a rank of an elastic Ray job"):
        ray_logger.log({"started": True})
