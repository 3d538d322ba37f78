"""Horovod's Module API path and a horovod.mxnet-style script, on 2 ranks."""
import os
import re

from runner import REPO, run_ranks


def test_module_fit_matches_single_process_global_batch():
    out = run_ranks("module_fit_worker.py", 2, timeout=120).stdout
    assert out.count("module fit ok") == 2, out


def test_horovod_style_example_trains():
    out = run_ranks(os.path.join(REPO, "examples", "horovod_api.py"), 2, timeout=120).stdout
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+) on 450 samples", out)]
    assert len(accuracies) == 8, out  # one line per epoch, from rank 0 only
    assert accuracies[-1] > 0.85, out
