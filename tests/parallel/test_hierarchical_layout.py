"""The hierarchical allreduce and allgather on made-up hosts of 3 ranks on one machine: a
host whose ranks are not consecutive, hosts of different sizes (workers/hierarchical_layout.py;
the real hosts are tests/multihost/test_multihost_hierarchical.py's)."""
import pytest

from runner import case_job, case_names


@pytest.mark.parametrize("case", case_names("hierarchical_layout.py"))
def test_hierarchical_on_hosts_of_scattered_ranks(case):
    case_job("hierarchical_layout.py", 3, timeout=120).check(case)
