"""Why a Spark job of hvd_trainer.spark.run failed, in words a user can act on, from the text
of the exception Spark gives the driver.

Spark says a barrier task failed (``ResultTask(stage, partition)``, the partition being the
task's index) and why: an executor lost with its exit code, a task's Python worker that
died, an exception such as ``OutOfMemoryError``, or results over
``spark.driver.maxResultSize``; the host is the one the task registered from.
"""
import re
from typing import Dict, Optional

_MEMORY = ("raise spark.executor.memory, or return less from the function (its results pass "
           "through the executor)")
# An executor's exit codes (Spark's own, and a signal's 128 + N): what each means.
EXIT_CODES = {
    50: "an uncaught exception in the executor JVM; one cause is a connection to a task's "
        "barrier socket that closes before it authenticates (Spark's SocketAuthHelper "
        "EOFException), which any local user can make to a TCP one: set "
        "spark.python.unix.domain.socket.enabled=true (docs/security.md)",
    52: f"the executor JVM ran out of memory (OutOfMemoryError): {_MEMORY}",
    137: "the executor was killed (SIGKILL: by a user, the cluster manager, or the kernel's "
         "out-of-memory killer)",
    143: "the executor was stopped (SIGTERM: by the cluster manager, or a user)",
}
# What Spark says when a task's Python worker dies (killed, or a crash in native code).
_WORKER_DIED = "Python worker exited unexpectedly (crashed)"
_RESULT_SIZE = re.compile(r"Total size of serialized results of \d+ tasks? \(([^)]*)\) is "
                          r"bigger than spark\.driver\.maxResultSize \(([^)]*)\)")
_TASK = re.compile(r"ResultTask\(\d+, (\d+)\)|Lost task [\d.]+ in stage [\d.]+ \(TID \d+\) "
                   r"\(([^ )]+)")
_EXIT = re.compile(r"Command exited with code (\d+)")
_THROWN = re.compile(r"^(?:java\.lang\.|org\.apache\.spark\.)?[\w.$]*(?:Error|Exception)\b.*$",
                     re.M)


def _spark_text(text: str) -> str:
    """The part of a Py4J error's text that Spark wrote (after its Java stack trace's head)."""
    return text.split("\n: ", 1)[-1] if "\n: " in text else text


def explain(text: str, hosts: Dict[int, str]) -> str:
    """What went wrong, from the text of the exception Spark raised (``hosts``: each task's
    host, by index): the host and what Spark said (an executor lost, with the meaning of its
    exit code; an exception such as OutOfMemoryError), or the result size over
    spark.driver.maxResultSize with how to raise it."""
    said = _spark_text(text)
    size = _RESULT_SIZE.search(said)
    if size:
        return (f"the tasks' results ({size[1]}: the ranks' return values) exceed "
                f"spark.driver.maxResultSize ({size[2]}): return less from the function, or "
                "raise the limit when the session is built (SparkSession.builder.config("
                "'spark.driver.maxResultSize', '4g'); 0 means none)")
    where = _where(said, hosts)
    lost = re.search(r"ExecutorLostFailure \(([^)]*)\)(?: Reason: (.*))?", said)
    if lost:
        reason = (lost[2] or "").strip()
        code = _EXIT.search(reason)
        meaning = EXIT_CODES.get(int(code[1])) if code else None
        return (f"the executor{' of ' + where if where else ''} was lost ({lost[1]}): Spark says "
                f"{reason or 'no more'!r}" + (f"; {meaning}" if meaning else ""))
    if _WORKER_DIED in said:
        return (f"the Python worker of {where or 'a task'} died: Spark says {_WORKER_DIED!r}; "
                "it was killed (SIGKILL: by a user, or the kernel's out-of-memory killer) or "
                "crashed in native code (spark.python.worker.faulthandler.enabled=true puts a "
                "crash's Python traceback in the executor's log)")
    thrown = next((line.strip() for line in _THROWN.findall(said)
                   if "Job aborted" not in line and "SparkException" not in line), None)
    if thrown and "OutOfMemoryError" in thrown:
        return f"{where or 'a task'} ran out of memory ({thrown}): {_MEMORY}"
    first = next((line.strip() for line in said.splitlines() if line.strip()), "")
    return f"{where or 'a task'} failed: {thrown or first}"


def _where(said: str, hosts: Dict[int, str]) -> str:
    """'task N on HOST' for the task Spark names, or ''."""
    found = _TASK.search(said)
    if not found:
        return ""
    if found[1] is not None:
        index = int(found[1])
        host: Optional[str] = hosts.get(index)
        return f"task {index}" + (f" on {host}" if host else "")
    return f"the task on {found[2]}"
