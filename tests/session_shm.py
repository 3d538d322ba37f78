"""A /dev/shm of the test session's own, so that what the suite leaves there can be counted.

Under root on Linux, :func:`make_private` (called from tests/conftest.py before pytest starts
a thread) gives this process a mount namespace of its own with a fresh tmpfs (the size of the
machine's) on /dev/shm: every job, rank and cluster the tests start shares it, and nothing
else on the machine writes there, so :func:`leftovers` at the end of the session is exactly
what the suite's runs left (MPI's segments of ranks that ended by ``os._exit`` or were killed,
elastic commit folders), whatever other users of the machine do meanwhile. Elsewhere nothing
changes and the check is not made.
"""
import ctypes
import os
import time
from typing import List, Optional

FOLDER = "/dev/shm"
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
# How long the ranks' output relays, which remove their rank's segments once it is gone,
# get after the last test before what is left counts. Watched test by test (2026-12-07), a
# segment outlived its test by up to 14 s (gone by the end of the next one), on two cores.
SETTLE_SECONDS = 30.0


def make_private() -> Optional[str]:
    """Mount a private tmpfs on /dev/shm for this process and its children; None once done,
    else why it was not (not root, not Linux, unshare refused)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not os.path.isdir(FOLDER):
        return "it needs root on Linux"
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.statvfs(FOLDER)
    options = f"size={size.f_blocks * size.f_frsize},mode=1777".encode()
    # A namespace of our own whose mounts do not propagate back to the machine's, then the tmpfs.
    for step, result in (
            ("unshare(CLONE_NEWNS)", lambda: libc.unshare(_CLONE_NEWNS)),
            ("making / private", lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE,
                                                    None)),
            (f"mounting a tmpfs on {FOLDER}", lambda: libc.mount(b"tmpfs", FOLDER.encode(),
                                                                 b"tmpfs", 0, options))):
        if result() != 0:
            return f"{step} failed: {os.strerror(ctypes.get_errno())}"
    return None


def leftovers() -> List[str]:
    """What is in the session's /dev/shm once the relays have settled (at most
    SETTLE_SECONDS): entries that no test removed, but for the MPI segment that this process
    itself uses (a test that imports mpi4py makes it an MPI singleton, whose MPI_Finalize at
    exit removes it)."""
    from hvd_trainer_launch.rank import segments
    own = {os.path.basename(path) for path in {**segments.mapped_segments(os.getpid()),
                                               **segments.open_segments(os.getpid())}}
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        found = sorted(set(os.listdir(FOLDER)) - own)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
