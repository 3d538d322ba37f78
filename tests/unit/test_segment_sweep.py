"""A rank's wrapper removes the Open MPI segments that a job killed whole left in /dev/shm
(hvdrun SIGKILLed: ranks and relays end together, so nobody removed them), and only those:
this host's and this user's, and none that a process still holds open or maps."""
import mmap
import os
import socket

import pytest

from hvd_trainer_launch.rank.segments import sweep_orphans

FOLDER = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(FOLDER), reason="no /dev/shm here")


def _segment(name: str) -> str:
    path = os.path.join(FOLDER, name)
    with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as f:
        f.write(bytes(4096))
    return path


def test_only_this_hosts_and_users_unused_segments_go():
    job = f"hvdtest{os.getpid():x}"
    mine = f"sm_segment.{socket.gethostname()}.{os.geteuid()}.{job}"
    orphan = _segment(f"{mine}.0")
    held = _segment(f"{mine}.1")
    mapped = _segment(f"{mine}.2")
    elsewhere = _segment(f"sm_segment.{job}-other-host.{os.geteuid()}.{job}.0")
    mpich = _segment(f"mpich_shm_{job}")
    holder = open(held, "rb")
    with open(mapped, "r+b") as f:
        view = mmap.mmap(f.fileno(), 4096)  # mapped, its file closed: as Open MPI keeps it
    try:
        assert orphan in sweep_orphans()
        assert not os.path.exists(orphan)
        assert all(os.path.exists(p) for p in (held, mapped, elsewhere, mpich))
    finally:
        holder.close()
        view.close()
        for path in (orphan, held, mapped, elsewhere, mpich):
            if os.path.exists(path):
                os.unlink(path)


def test_a_segment_freed_later_goes_at_the_next_sweep():
    path = _segment(f"sm_segment.{socket.gethostname()}.{os.geteuid()}.hvdtest{os.getpid():x}b.0")
    holder = open(path, "rb")
    try:
        assert path not in sweep_orphans()
        holder.close()
        assert path in sweep_orphans() and not os.path.exists(path)
    finally:
        holder.close()
        if os.path.exists(path):
            os.unlink(path)
