"""Without a launcher the world has one rank and needs no MPI; collectives follow Horovod."""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import hvd_trainer as hvd
from hvd_trainer.runtime import config
from hvd_trainer.backends import split_evenly
from hvd_trainer.backends.mpi import _pieces


def test_plain_python_gives_a_size_one_world_without_mpi():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI", "OMPI", "PMIX", "SLURM", "HVD_", "HOROVOD_", "MPI_"))}
    code = ("import sys, numpy as np, hvd_trainer as h; "
            "print(h.size(), h.rank(), h.local_size(), h.allreduce(np.arange(3.)).tolist(), "
            "'mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["1", "0", "1", "[0.0,", "1.0,", "2.0]", "False"]


def test_size_one_collectives():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0), 2 * x)
    np.testing.assert_array_equal(hvd.allgather(x), x)
    np.testing.assert_array_equal(hvd.broadcast(x, root_rank=0), x)
    np.testing.assert_array_equal(hvd.reducescatter(x), x)
    out, received = hvd.alltoall(x, splits=[2])
    np.testing.assert_array_equal(out, x)
    assert received.tolist() == [2]
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.allgather_object(3) == [3]


def test_tensor_arguments_may_be_passed_by_keyword():
    x = np.arange(4.0)
    np.testing.assert_array_equal(hvd.allreduce(tensor=x, op=hvd.Sum), x)
    got = hvd.grouped_allreduce(tensors=[x, 2 * x], op=hvd.Sum)
    np.testing.assert_array_equal(got[1], 2 * x)
    assert hvd.grouped_allreduce_(tensors=[x])[0] is x
    np.testing.assert_array_equal(hvd.broadcast(tensor=x, root_rank=0), x)
    np.testing.assert_array_equal(hvd.reducescatter(tensor=x), x)


def test_init_twice_is_harmless_and_state_survives():
    hvd.init()
    hvd.init()
    assert hvd.is_initialized() and hvd.size() == 1


@pytest.mark.parametrize("call, error, word", [
    (lambda: hvd.allreduce([1.0]), TypeError, "tensor must be a numpy.ndarray"),
    (lambda: hvd.allreduce(np.array([object()])), TypeError, "dtype object"),
    (lambda: hvd.allreduce(np.zeros(2), op=7), ValueError, "op=7"),
    (lambda: hvd.broadcast(np.zeros(2), root_rank=1), ValueError, "root_rank=1"),
    (lambda: hvd.broadcast(np.zeros(2), root_rank=-1), ValueError, "root_rank=-1"),
    (lambda: hvd.allreduce_(np.zeros((3, 3))[::2]), ValueError, "C-contiguous"),
    (lambda: hvd.grouped_allreduce_([np.zeros(2), np.zeros(3).view()[::-1]]), ValueError, "tensors[1]"),
    (lambda: hvd.allgather(np.float32(1.0)), TypeError, "numpy.ndarray"),
    (lambda: hvd.allgather(np.array(1.0)), ValueError, "at least one dimension"),
    (lambda: hvd.alltoall(np.zeros(3), splits=[2]), ValueError, "splits"),
])
def test_bad_arguments_name_the_problem(call, error, word):
    with pytest.raises(error) as info:
        call()
    assert word in str(info.value)


def test_out_of_place_accepts_strided_input():
    x = np.arange(12.0).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum), x)


def test_unregistered_process_set_is_an_error():
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(np.zeros(1), process_set=hvd.ProcessSet([0]))


def test_env_reads_horovod_spelling_as_fallback(monkeypatch):
    monkeypatch.delenv("HVD_FUSION_THRESHOLD", raising=False)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    assert config.env("FUSION_THRESHOLD", "7") == "1024"
    monkeypatch.setenv("HVD_FUSION_THRESHOLD", "2048")
    assert config.env("FUSION_THRESHOLD", "7") == "2048"
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD")
    monkeypatch.setenv("HVD_FUSION_THRESHOLD", "")
    assert config.env("FUSION_THRESHOLD", "7") == "7"


@pytest.mark.parametrize("count, parts", [(0, 3), (2, 3), (10, 3), (9, 3), (7, 2)])
def test_ring_chunks_cover_the_buffer_evenly(count, parts):
    bounds = split_evenly(count, parts)
    sizes = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == count and len(sizes) == parts
    assert sizes.max() - sizes.min() <= (1 if count else 0)


@pytest.mark.parametrize("count, limit, pieces", [
    (2500, 1000, [(0, 1000), (1000, 2000), (2000, 2500)]),
    (2000, 1000, [(0, 1000), (1000, 2000)]),
    (5, 1000, [(0, 5)]),
    (0, 1000, [(0, 0)]),  # an empty message is still one message, on both sides
    (3, 1, [(0, 1), (1, 2), (2, 3)]),
])
def test_messages_over_the_count_limit_are_cut_into_pieces(count, limit, pieces):
    assert _pieces(count, limit) == pieces


def test_log_level_debug_reports_the_backend():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI", "PMIX", "HVD_"))}
    env["HVD_LOG_LEVEL"] = "debug"
    err = subprocess.run([sys.executable, "-c", "import hvd_trainer as h; h.init()"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stderr
    assert "rank 0 of 1 on the local backend" in err
    env["HVD_LOG_LEVEL"] = "chatty"
    proc = subprocess.run([sys.executable, "-c", "import hvd_trainer as h; h.init()"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "HVD_LOG_LEVEL='chatty'" in proc.stderr


def test_capability_queries_answer_for_a_size_one_world():
    assert hvd.mpi_built() is True  # mpi4py is installed with the test extra
    assert (hvd.mpi_enabled(), hvd.mpi_threads_supported(), hvd.is_homogeneous()) == (False, False, True)
    assert not any(f() for f in (hvd.gloo_built, hvd.gloo_enabled, hvd.ccl_built,
                                 hvd.rocm_built, hvd.ddl_built))


def test_cuda_queries_are_false_without_cupy():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here; tests/gpu checks cuda_built() where a GPU is")
    assert (hvd.cuda_built(), hvd.nccl_built()) == (False, False)


def test_top_level_distributed_optimizer_names_both_adapters():
    with pytest.raises(AttributeError, match="hvd_trainer.mxnet.DistributedOptimizer.*"
                                             "hvd_trainer.torch.DistributedOptimizer"):
        hvd.DistributedOptimizer  # noqa: B018
