"""hvdrun's HOROVOD_* variables on 2 and 3 ranks equal what hvd_trainer reports from MPI's own
split of the world (rank, size, local and cross), on one host and on the two hosts that
``-H localhost:N,127.0.0.1:1`` names, statically and in elastic mode, under the MPI in use.
HOROVOD_HOSTNAME is checked by hand: Hydra makes each -H entry a node of its own, Open MPI
one node of the names of this machine (named by the first)."""
import json

import pytest

from hvd_trainer_launch import mpi
from runner import run_ranks

FLAVOUR = mpi.find_launcher().flavour


def places(out: str) -> list:
    """The workers' PLACE lines, in rank order."""
    found = [json.loads(line.split("PLACE ", 1)[1]) for line in out.splitlines() if "PLACE " in line]
    return sorted(found, key=lambda place: int(place["mpi"]["RANK"]))


def two_hosts(np_: int) -> list:
    """``-H`` with localhost taking all ranks but one, and 127.0.0.1 the last."""
    return ["-H", f"localhost:{np_ - 1},127.0.0.1:1"]


@pytest.mark.parametrize("layout", ["one host", "two host names", "elastic, two host names"])
@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_variables_equal_what_hvd_trainer_reports(np_, layout):
    hosts = [] if layout == "one host" else two_hosts(np_)
    elastic = ["--min-np", "2"] if layout.startswith("elastic") else []
    found = places(run_ranks("horovod_variables_worker.py", np_, hvdrun_args=hosts + elastic,
                             timeout=120).stdout)
    assert len(found) == np_
    if hosts and FLAVOUR == mpi.HYDRA:  # two nodes: the last rank alone on 127.0.0.1
        names = ["localhost"] * (np_ - 1) + ["127.0.0.1"]
    else:  # one node (Open MPI makes one of localhost and 127.0.0.1)
        names = ["localhost"] * np_
    for place, name in zip(found, names):
        assert place["env"] == dict(place["mpi"], HOSTNAME=name)
    if hosts and FLAVOUR == mpi.HYDRA:
        assert found[-1]["mpi"]["CROSS_RANK"] == "1" and found[-1]["mpi"]["LOCAL_SIZE"] == "1"


@pytest.mark.skipif(FLAVOUR != mpi.HYDRA, reason="every host here is this machine, which Open "
                                                  "MPI makes one node: it cannot place ranks "
                                                  "otherwise than -H says")
def test_ranks_placed_otherwise_than_hosts_say_get_no_wrong_local_variables():
    # Hydra's -ppn 1 deals the ranks out one per node: rank 1 lands on 127.0.0.1, where -H
    # says localhost. The ranks it moved warn and set only HOROVOD_RANK and HOROVOD_SIZE.
    result = run_ranks("horovod_variables_worker.py", 3, timeout=120,
                       hvdrun_args=two_hosts(3) + ["--mpi-args=-ppn 1"])
    found = places(result.stdout)
    assert [sorted(place["env"]) for place in found[1:]] == [["RANK", "SIZE"]] * 2
    assert found[0]["env"] == dict(found[0]["mpi"], HOSTNAME="localhost")
    for rank in (1, 2):
        assert f"mpiexec placed rank {rank} otherwise than the hosts given" in result.stderr
        assert found[rank]["env"] == {k: found[rank]["mpi"][k] for k in ("RANK", "SIZE")}
