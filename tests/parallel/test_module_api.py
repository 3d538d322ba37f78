"""Horovod's Module API path and a horovod.mxnet-style script, on 2 ranks."""
import os
import re

import pytest

from runner import REPO, case_job, case_names, run_ranks


@pytest.mark.parametrize("case", case_names("module_fit_worker.py"))
def test_module_fit_matches_single_process_global_batch(case):
    case_job("module_fit_worker.py", 2, timeout=120).check(case)


def test_horovod_style_example_trains():
    out = run_ranks(os.path.join(REPO, "examples", "horovod_api.py"), 2, timeout=120).stdout
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+) on 450 samples", out)]
    assert len(accuracies) == 8, out  # one line per epoch, from rank 0 only
    assert accuracies[-1] > 0.85, out
