"""hvd_trainer.ray.ElasticRayExecutor on a real local Ray instance: three hosts that the
head answers to (engines.RAY_FAKE_HOSTS), reported by a discovery the test changes. Checked:
a training whose actor on one host is killed (its ranks with it) and whose host the discovery
drops shrinks to the two others, grows back to three when the host returns, and ends with
weights equal to the committed steps replayed in one process, no commit lost (the life after
the loss starts at or after the last commit seen); Ray's own discovery (RayHostDiscovery)
against ray.nodes(); RayExecutor's elastic form; fewer hosts than min_num_proc ends with the
reason within elastic_timeout; no process or folder left behind. Where the multi-host test
bed trains through the same loss and return across its hosts in this session
(test_multihost_ray_elastic.py, a raylet SIGKILLed), that run stands for the training here
(tests/bed_twins.py)."""
import glob
import os
import signal
import sys
import tempfile
import threading
import time

import cloudpickle
import pytest

import bed_twins
import elastic_loops
import engines
from hvd_trainer_launch import mpi
from hvd_trainer_launch.engines import agent as engine_agent, elastic, launch as engine_launch
from hvd_trainer_launch.engines.calls import EngineError

pytestmark = pytest.mark.skipif(
    engine_launch.check_launcher().flavour != mpi.HYDRA,
    reason="three agents on one machine: Open MPI's daemons collide (tests/multihost)")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
LIMIT = 400  # steps at most: the job ends elastic_loops.GROWN_STEPS steps after it grows back


class Discovery:
    """Horovod's discovery interface, with hosts the test changes."""

    def __init__(self, hosts):
        self.hosts = dict(hosts)

    def find_available_hosts_and_slots(self):
        return dict(self.hosts)


def _no_leftovers(before):
    """Nothing of the job left: no process, commits folder or discovery folder beyond
    ``before`` (:func:`_leftovers` before it; other sessions' jobs share the folder)."""
    deadline = time.monotonic() + 30
    while _leftovers() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers() - before == set()


def _leftovers():
    return set(map(str, engines.job_processes())) | set(
        glob.glob(os.path.join(tempfile.gettempdir(), engine_agent.COMMITS_PREFIX + "*"))
        + glob.glob(os.path.join(tempfile.gettempdir(), elastic.FOLDER_PREFIX + "*")))


def test_actor_loss_shrinks_and_return_grows_with_no_commit_lost(request, ray_cluster,
                                                                 tmp_path):
    bed_twins.skip_if_the_bed_runs(
        request, "tests/multihost/test_multihost_ray_elastic.py::"
                 "test_raylet_killed_on_h3_shrinks_and_its_return_grows_with_no_commit_lost")
    before = _leftovers()
    from hvd_trainer.ray import ElasticRayExecutor
    progress = str(tmp_path / "progress")
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                  elastic_timeout=60, timeout_s=60)
    settings.discovery = Discovery({host: 1 for host in engines.RAY_FAKE_HOSTS})
    executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    executor.start()
    results = []
    runner = threading.Thread(target=lambda: results.append(
        executor.run(elastic_loops.train, args=(LIMIT, progress))))
    runner.start()
    try:
        elastic_loops.wait(lambda: elastic_loops.commits_on_three(progress) >= 4)
        seen = int(elastic_loops.notes(progress, "commit")[-1][0])
        actor, host = elastic_loops.notes(progress, "last")[-1]
        del settings.discovery.hosts[host]  # its node is gone ...
        os.kill(int(actor), signal.SIGKILL)  # ... and its actor with it
        elastic_loops.wait(lambda: any(size == "2" for _, size in elastic_loops.notes(progress, "start")))
        elastic_loops.wait(lambda: int(elastic_loops.notes(progress, "commit")[-1][0]) >= seen + 2)
        settings.discovery.hosts[host] = 1  # it comes back
        runner.join(300)
    finally:
        runner.join(300)
    assert results, "the job did not end"
    elastic_loops.check(results[0], progress, seen, grew_in_place=True)
    _no_leftovers(before)


def _size():
    import hvd_trainer as hvd
    from hvd_trainer.ray import ray_logger
    hvd.init()
    ray_logger.log({"rank": hvd.rank(), "size": hvd.size()})
    return hvd.size()


def test_rays_own_discovery_and_the_elastic_form_of_ray_executor(ray_cluster):
    before = _leftovers()
    from hvd_trainer.ray import RayExecutor, RayHostDiscovery
    head = ray_cluster.util.get_node_ip_address()  # the head, by its address
    found = RayHostDiscovery(cpus_per_slot=1).find_available_hosts_and_slots()
    assert found == {head: engines.RAY_CPUS}
    assert RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots() == {head: 1}
    assert RayHostDiscovery(use_gpu=True).find_available_hosts_and_slots() == {head: 0}
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=1,
                           max_workers=2, cpus_per_worker=1)
    executor.start()
    events = []
    assert executor.run(_size, callbacks=[events.append]) == [2, 2]  # max_workers of 3 slots
    # Each callback gets what the ranks logged (horovod.ray.ray_logger), not the results.
    assert sorted(events, key=lambda event: event["rank"]) == [{"rank": 0, "size": 2},
                                                               {"rank": 1, "size": 2}]
    executor.shutdown()
    _no_leftovers(before)


def test_too_few_hosts_ends_with_the_reason(ray_cluster):
    before = _leftovers()
    from hvd_trainer.ray import ElasticRayExecutor
    settings = ElasticRayExecutor.create_settings(min_num_proc=4, elastic_timeout=3)
    settings.discovery = Discovery({host: 1 for host in engines.RAY_FAKE_HOSTS})
    executor = ElasticRayExecutor(settings, override_discovery=False)
    executor.start()
    # (The three actors may not all be up within the 3 s.)
    with pytest.raises(EngineError, match=r"only \d usable slots .* for --elastic-timeout 3 s, "
                                          r"fewer than --min-np 4"):
        executor.run(_size)
    _no_leftovers(before)
