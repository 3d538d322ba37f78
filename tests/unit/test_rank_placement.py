"""The per-rank wrapper's Horovod variables from hvdrun's nodes, against hand-computed layouts;
a rank that mpiexec placed otherwise gets a warning and no local or cross variables."""
import json

import pytest

from hvd_trainer_launch.rank import wrapper as worker

# Nodes a:3, b:1, c:2 (ranks 0-2, 3, 4-5). Local rank 0 is on a, b, c; 1 on a and c; 2 on a.
THREE_NODES = [("a", 3), ("b", 1), ("c", 2)]
EXPECTED = {  # rank: (local rank, local size, cross rank, cross size, host)
    0: (0, 3, 0, 3, "a"), 1: (1, 3, 0, 2, "a"), 2: (2, 3, 0, 1, "a"),
    3: (0, 1, 1, 3, "b"),
    4: (0, 2, 2, 3, "c"), 5: (1, 2, 1, 2, "c"),
}


@pytest.mark.parametrize("rank", sorted(EXPECTED))
def test_variables_follow_the_nodes_as_mpi_splits_them(rank):
    local_rank, local_size, cross_rank, cross_size, host = EXPECTED[rank]
    assert worker.horovod_variables(THREE_NODES, rank) == {
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "6", "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size), "HOROVOD_CROSS_RANK": str(cross_rank),
        "HOROVOD_CROSS_SIZE": str(cross_size), "HOROVOD_HOSTNAME": host}


def test_a_rank_beyond_the_nodes_is_an_error():
    with pytest.raises(ValueError, match="rank 6 is beyond the 6 ranks of HVDRUN_HOSTS"):
        worker.horovod_variables(THREE_NODES, 6)


def hydra_env(rank, local_rank, local_size, **extra):
    return {worker.HOSTS_VARIABLE: json.dumps(THREE_NODES), "MPI_LOCALRANKID": str(local_rank),
            "MPI_LOCALNRANKS": str(local_size), **extra}


def test_the_variables_replace_an_enclosing_job_s():
    env = hydra_env(4, 0, 2, HOROVOD_RANK="9", HOROVOD_HOSTNAME="elsewhere")
    assert worker._with_horovod_variables(env, 4) == b""
    assert env["HOROVOD_RANK"] == "4" and env["HOROVOD_HOSTNAME"] == "c"


@pytest.mark.parametrize("launcher", [{"MPI_LOCALRANKID": "0"}, {"MPI_LOCALNRANKS": "3"},
                                      {"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}])
def test_a_rank_placed_otherwise_warns_and_sets_only_rank_and_size(launcher):
    env = dict(hydra_env(5, 1, 2, HOROVOD_CROSS_RANK="7"), **launcher)
    warning = worker._with_horovod_variables(env, 5).decode()
    assert warning.startswith("[5]<stderr>:hvdrun: warning: mpiexec placed rank 5 otherwise "
                              "than the hosts given (")
    assert warning.endswith("HOROVOD_LOCAL_*, HOROVOD_CROSS_* and HOROVOD_HOSTNAME are not "
                            "set (hvd_trainer.local_rank() and the others ask MPI)\n")
    names = worker.horovod_variables(THREE_NODES, 5)
    assert {name: env.get(name) for name in names} == dict(
        dict.fromkeys(names), HOROVOD_RANK="5", HOROVOD_SIZE="6")
