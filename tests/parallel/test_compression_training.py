"""Compressed DistributedTrainer on 2 and 3 ranks: MXNet's own 2-bit as reference, identical
weights on every rank, residuals in save_states, byte counts; digits convergence."""
import os
import re
import sys

import pytest

from runner import REPO, run_ranks

CASES = 5


@pytest.mark.parametrize("np_", [2, 3])
def test_compression_cases(np_, tmp_path):
    out = run_ranks("compression_cases.py", np_, [str(tmp_path)], timeout=120).stdout
    assert out.count("all compression cases passed") == np_
    assert out.count("OK ") == CASES
