"""Outputs written as the job goes (a rank's output copied by hvdrun, a timeline, an autotune
log): files that can never end the job, opened without following a planted symlink.

Standard library only: hvdrun's output relay (--output-filename) uses it without importing
hvd_trainer, and the ranks' timeline and autotune log use the same class.
"""
import logging
import os
import stat
import tempfile
from typing import BinaryIO, Callable, Optional, Union

log = logging.getLogger("hvd_trainer")


class Output:
    """A file written as the job goes (a log, a trace, a copy of a rank's output) that can
    never end the job: a failure to open or write it (folder missing, disk full) warns once,
    naming the file, and stops that output; writes after it do nothing.

    A new output replaces ``path`` with a fresh 0600 file (made like :func:`write_atomically`'s
    temporary file, then renamed into place). With ``append``, ``path`` is opened without
    following a symlink, created 0600 when missing, and used only when it is a regular file
    of this process's user. ``warn`` receives the one message (the 'hvd_trainer' logger's
    warning by default).
    """

    def __init__(self, path: str, append: bool = False, what: str = "output",
                 warn: Optional[Callable[[str], None]] = None):
        self.path, self.what = path, what
        self._warn = warn or log.warning
        self._file: Optional[BinaryIO] = None
        self.was_empty = False  # whether the file held nothing when it was opened
        try:
            fd = self._open_append() if append else self._open_new()
            self._file = os.fdopen(fd, "wb")
            self.was_empty = os.fstat(fd).st_size == 0
        except OSError as error:
            self._stop(error)

    @property
    def active(self) -> bool:
        """Whether the output is still written (it opened and no write has failed)."""
        return self._file is not None

    def _open_new(self) -> int:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.", suffix=".tmp",
                                   dir=os.path.dirname(os.path.abspath(self.path)))
        try:
            os.replace(tmp, self.path)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        return fd

    def _open_append(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)
            raise PermissionError(f"it is not a regular file of this job's user (id {os.geteuid()})")
        return fd

    def write(self, data: Union[bytes, str]) -> None:
        """Write ``data`` (text as UTF-8); buffered until :meth:`flush`."""
        if self._file is None:
            return
        try:
            self._file.write(data.encode() if isinstance(data, str) else data)
        except OSError as error:
            self._stop(error)

    def flush(self) -> None:
        """Hand what was written to the operating system."""
        if self._file is None:
            return
        try:
            self._file.flush()
        except OSError as error:
            self._stop(error)

    def close(self) -> None:
        """Flush and close; the output stops."""
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError as error:
            self._stop(error)
        self._file = None

    def _stop(self, error: OSError) -> None:
        """Warn once, naming the file and the error, and drop the file without raising."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # the buffer that failed to write fails again; it is dropped
                pass
            self._file = None
        self._warn(f"cannot write the {self.what} {self.path!r} ({error}); this output stops "
                   "here and the job goes on")
