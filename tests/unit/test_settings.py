"""Wire settings are agreed at init: rank 0's values, and any rank's parse error on every rank.

Each rank's view comes from config.read_settings under its own environment;
config.agree_settings is what every rank computes from all the views.
"""
import logging
import os
import subprocess
import sys

import pytest

from hvd_trainer.runtime import config

NAMES = ("FUSION_THRESHOLD", "ALLREDUCE_ALGO", "RING_THRESHOLD", "BUCKET_THRESHOLD", "OVERLAP",
         "GPU_COMMUNICATOR", "AUTOTUNE", "AUTOTUNE_LOG", "AUTOTUNE_WARMUP_SAMPLES",
         "AUTOTUNE_STEPS_PER_SAMPLE", "STALL_CHECK_TIME_SECONDS", "STALL_SHUTDOWN_TIME_SECONDS")


def view(monkeypatch, **values):
    """One rank's settings, read with exactly ``values`` (HVD_ names) in its environment."""
    for name in NAMES:
        monkeypatch.delenv(f"HVD_{name}", raising=False)
        monkeypatch.delenv(f"HOROVOD_{name}", raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return config.read_settings()


def test_without_settings_every_rank_uses_the_defaults(monkeypatch):
    chosen = config.agree_settings([view(monkeypatch)] * 2, 1)
    assert chosen == {"FUSION_THRESHOLD": 64 << 20, "ALLREDUCE_ALGO": "auto",
                      "RING_THRESHOLD": 1 << 20, "BUCKET_THRESHOLD": 16 << 20, "OVERLAP": 0,
                      "GPU_COMMUNICATOR": "auto", "HIERARCHICAL_ALLREDUCE": 0,
                      "HIERARCHICAL_ALLGATHER": 0, "AUTOTUNE": 0, "AUTOTUNE_LOG": "",
                      "AUTOTUNE_WARMUP_SAMPLES": 3, "AUTOTUNE_STEPS_PER_SAMPLE": 10,
                      "STALL_CHECK_TIME_SECONDS": 60.0, "STALL_SHUTDOWN_TIME_SECONDS": 0.0}


def test_rank_0s_values_win_and_a_rank_that_differs_says_so(monkeypatch, caplog):
    every = [view(monkeypatch, HVD_FUSION_THRESHOLD="1000", HOROVOD_RING_THRESHOLD="1e3"),
             view(monkeypatch, HVD_ALLREDUCE_ALGO="ring", HVD_FUSION_THRESHOLD="5000"),
             view(monkeypatch, HVD_FUSION_THRESHOLD="1000.0", HVD_RING_THRESHOLD="1000")]
    for rank in range(3):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hvd_trainer"):
            chosen = config.agree_settings(every, rank)
        assert (chosen["FUSION_THRESHOLD"], chosen["ALLREDUCE_ALGO"],
                chosen["RING_THRESHOLD"]) == (1000, "auto", 1000)
        warned = sorted(r.getMessage() for r in caplog.records)
        if rank == 1:
            assert warned == [
                "HVD_ALLREDUCE_ALGO is 'ring' on rank 1 but None on rank 0; every rank uses "
                "rank 0's value so that all ranks move the same bytes",
                "HVD_FUSION_THRESHOLD is '5000' on rank 1 but '1000' on rank 0; every rank "
                "uses rank 0's value so that all ranks move the same bytes",
                "HVD_RING_THRESHOLD is None on rank 1 but '1e3' on rank 0; every rank uses "
                "rank 0's value so that all ranks move the same bytes"]
        else:  # the same values, however spelled
            assert warned == []


@pytest.mark.parametrize("variable, value, words", [
    ("HVD_FUSION_THRESHOLD", "64MB", "is not a number"),
    ("HVD_RING_THRESHOLD", "-5", "is negative"),
    ("HVD_ALLREDUCE_ALGO", "tree", "is not an allreduce algorithm"),
    ("HVD_GPU_COMMUNICATOR", "gloo", "is not a GPU communicator"),
    ("HVD_AUTOTUNE_STEPS_PER_SAMPLE", "-2", "is negative; set it to 0 or more"),
    ("HVD_FUSION_THRESHOLD", "inf", "is not a finite number"),
    ("HVD_BUCKET_THRESHOLD", "nan", "is not a finite number"),
    ("HVD_STALL_CHECK_TIME_SECONDS", "nan", "is not a number of seconds >= 0"),
    ("HVD_STALL_SHUTDOWN_TIME_SECONDS", "-1", "is not a number of seconds >= 0"),
    ("HVD_STALL_CHECK_TIME_SECONDS", "soon", "is not a number of seconds"),
])
def test_a_parse_error_on_one_rank_raises_on_every_rank_naming_it(monkeypatch, variable,
                                                                   value, words):
    every = [view(monkeypatch), view(monkeypatch), view(monkeypatch, **{variable: value})]
    for rank in range(3):
        with pytest.raises(ValueError) as raised:
            config.agree_settings(every, rank)
        assert str(raised.value).startswith(f"rank 2: {variable}={value!r} {words}")


def test_the_first_rank_with_an_error_is_named(monkeypatch):
    every = [view(monkeypatch), view(monkeypatch, HVD_OVERLAP="yes"),
             view(monkeypatch, HVD_FUSION_THRESHOLD="x")]
    with pytest.raises(ValueError, match=r"^rank 1: HVD_OVERLAP='yes' is not a number"):
        config.agree_settings(every, 2)


def test_stall_times_are_each_ranks_own(monkeypatch, caplog):
    every = [view(monkeypatch, HVD_STALL_CHECK_TIME_SECONDS="30"),
             view(monkeypatch, HVD_STALL_CHECK_TIME_SECONDS="5", HVD_STALL_SHUTDOWN_TIME_SECONDS="9")]
    with caplog.at_level(logging.WARNING, logger="hvd_trainer"):
        chosen = config.agree_settings(every, 1)
    assert (chosen["STALL_CHECK_TIME_SECONDS"], chosen["STALL_SHUTDOWN_TIME_SECONDS"]) == (5.0, 9.0)
    assert not caplog.records


@pytest.mark.parametrize("value", ["nccl", "gloo"])
def test_a_backend_that_is_not_mpi_or_local_is_refused_naming_the_variable(value):
    env = dict(os.environ, HVD_BACKEND=value)
    result = subprocess.run([sys.executable, "-c", "import hvd_trainer; hvd_trainer.init()"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"ValueError: HVD_BACKEND={value!r} is not a backend; use mpi or local" in result.stderr
