"""The job that benchmarks/elastic_engines.py times, and what runs inside the test bed's hosts:
each rank's training (``train``, with its marks), the driver on h1 of each engine's rounds
(``--drive ENGINE``), the rank command of hvdrun's own elastic job (``--worker FOLDER``), and
the killer that takes h3 away inside h3 (``--kill ENGINE FOLDER MARKER``). Run by
elastic_engines.py only. In a driver this file is ``__main__``: ``train`` travels to the
engines' ranks by value.
"""
import argparse
import json
import os
import subprocess
import sys
import time

MIN_NP, MAX_NP = 2, 3
PAUSE = 0.1  # seconds between steps
MARKS = "marks"
STOP = "stop"


# -- the ranks ---------------------------------------------------------------------------

def parent_started() -> float:
    """When this process's parent (hvdrun's wrapper) started, on the wall clock (/proc,
    10 ms ticks)."""
    with open("/proc/self/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{parent}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_boot


def train(folder: str) -> int:
    """The training on each rank, its marks appended to ``folder``/marks; returns the steps
    made when ``folder``/stop appears."""
    began = time.time()
    import socket

    import torch
    imported = time.time()
    import hvd_trainer.torch as hvd
    hvd.init()
    life = int(os.environ.get("HVD_ELASTIC_RESTART", "0"))

    def note(event: str, at: float = 0.0, rank: int = -1) -> None:
        if rank >= 0 and hvd.rank() != rank:
            return
        line = json.dumps({"life": life, "rank": hvd.rank(), "size": hvd.size(),
                           "host": socket.gethostname(), "pid": os.getpid(),
                           "event": event, "t": at or time.time()}) + "\n"
        fd = os.open(os.path.join(folder, MARKS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    for event, at in (("wrapper", parent_started()), ("python", began),
                      ("framework", imported), ("init", time.time())):
        note(event, at)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters())
    note("model")

    @hvd.elastic.run
    def loop(state):
        note("restored")
        first = True
        while True:
            optimizer.zero_grad()
            model(torch.full((8, 16), float(state.step % 7))).pow(2).mean().backward()
            optimizer.step()
            state.step += 1
            if first:
                note("first_step")
                first = False
            stop = hvd.allreduce(torch.tensor([float(os.path.exists(os.path.join(folder, STOP)))]),
                                 op=hvd.Sum, name="stop")
            try:
                state.commit()
            except hvd.elastic.HostsUpdatedInterrupt:
                note("interrupted")
                raise
            note("step", rank=0)
            if stop.item() > 0:
                return state.step
            time.sleep(PAUSE)

    return loop(hvd.elastic.TorchState(model, optimizer, step=0))


def read_marks(folder: str) -> list:
    """The ranks' marks so far (a line cut short by a kill is left out)."""
    path = os.path.join(folder, MARKS)
    if not os.path.exists(path):
        return []
    marks = []
    with open(path) as f:
        for line in f:
            try:
                marks.append(json.loads(line))
            except ValueError:
                pass
    return marks


# -- the driver on h1 ---------------------------------------------------------------------

class Stamped:
    """A binary stream (AgentLaunch's ``err``, and ``sys.stderr`` for Ray's) that keeps each
    line written to it with the time it came: hvdrun's messages."""

    def __init__(self):
        self.lines = []
        self.buffer = self

    def write(self, data) -> int:
        at = time.time()
        text = data if isinstance(data, str) else data.decode(errors="replace")
        self.lines += [(at, line) for line in text.splitlines() if line.strip()]
        return len(data)

    def flush(self) -> None:
        pass


def record_job_events(events: list) -> None:
    """Note, in ``events``, each time an engine tells its elastic job that a host joined,
    left, was lost or returned a life's outcome (engines.elastic.ElasticJob's methods)."""
    from hvd_trainer_launch.engines.elastic import ElasticJob
    for name, where in (("joined", 0), ("left", 0), ("lost", 1), ("returned", 1)):
        method = getattr(ElasticJob, name)

        def noted(self, *args, _method=method, _name=name, _where=where, **kwargs):
            events.append((time.time(), _name, str(args[_where])))
            return _method(self, *args, **kwargs)
        setattr(ElasticJob, name, noted)


class RecordedDiscovery:
    """Ray's discovery (RayHostDiscovery), noting in ``events`` each change of its hosts."""

    def __init__(self, inner, events: list):
        self.inner, self.events, self.last = inner, events, None

    def find_available_hosts_and_slots(self) -> dict:
        found = self.inner.find_available_hosts_and_slots()
        if sorted(found) != self.last:
            self.last = sorted(found)
            self.events.append((time.time(), "discovered", ",".join(self.last)))
        return found


def save_round(folder: str, events: list, stamped: Stamped, error: str) -> None:
    """The round's record, whole at once (the orchestrator reads it as soon as it exists)."""
    path = os.path.join(folder, "driver.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"events": events, "messages": stamped.lines, "error": error}, f)
    os.replace(path + ".tmp", path)


def drive_ray(args) -> None:
    import ray
    from hvd_trainer.ray import ElasticRayExecutor, RayHostDiscovery
    ray.init(address=args.address, log_to_driver=False)
    deadline = time.monotonic() + 120
    while sum(node["Alive"] for node in ray.nodes()) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    events: list = []
    record_job_events(events)
    for folder in args.folders:
        del events[:]
        settings = ElasticRayExecutor.create_settings(
            min_num_proc=MIN_NP, max_num_proc=MAX_NP, elastic_timeout=120,  # timeout_s: 30
            ulfm=args.ulfm)
        # Until Ray marks h3's node dead a life may start there and fail: a host that fails
        # in two lives in a row stays out for the cooldown only (as the bed's test has it).
        settings.cooldown_range = (1, 3)
        settings.discovery = RecordedDiscovery(RayHostDiscovery(cpus_per_slot=1), events)
        executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
        executor.start()
        stamped, error = Stamped(), ""
        sys.stderr = stamped  # the job's hvdrun writes its messages to sys.stderr.buffer
        try:
            executor.run(train, args=[folder])
        except Exception as failure:
            error = repr(failure)
        finally:
            sys.stderr = sys.__stderr__
        save_round(folder, events, stamped, error)


def drive_spark(args) -> None:
    import hvd_trainer.spark
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import bed_spark_session
    session = bed_spark_session(args.address, args.driver_host, args.jvm_options,
                                "hvd_trainer elastic engines")
    events: list = []
    record_job_events(events)
    for folder in args.folders:
        del events[:]
        stamped, error = Stamped(), ""
        try:
            hvd_trainer.spark.run_elastic(train, args=(folder,), num_proc=MAX_NP,
                                          min_num_proc=MIN_NP, max_num_proc=MAX_NP,
                                          start_timeout=60, elastic_timeout=120,
                                          stderr=stamped, ulfm=args.ulfm)
        except Exception as failure:
            error = repr(failure)
        save_round(folder, events, stamped, error)
    session.stop()


def drive_hvdrun(args) -> None:
    for folder in args.folders:
        stamped = Stamped()
        command = [sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "--min-np", str(MIN_NP),
                   "--max-np", str(MAX_NP), "--host-discovery-script",
                   os.path.join(folder, "discover"), "--elastic-timeout", "120",
                   "--blacklist-cooldown-range", "1", "3", *(["--ulfm"] if args.ulfm else []),
                   sys.executable, os.path.abspath(__file__), "--worker", folder]
        job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for line in iter(job.stderr.readline, b""):
            stamped.write(line)
        code = job.wait()
        save_round(folder, [], stamped, f"hvdrun exited with code {code}" if code else "")


# -- on h3: the loss -----------------------------------------------------------------------

def kill(engine: str, folder: str, marker: str) -> None:
    """Inside h3 (its own PID namespace): SIGKILL what the loss takes (Ray: the raylet;
    Spark: the worker, its executor and all they started, which carry ``marker`` in their
    environment; hvdrun: h3's rank, ``marker`` its PID, then h3 out of the discovery),
    writing the time of the first kill to ``folder``/loss."""
    import signal
    targets = [int(marker)] if engine == "hvdrun" else []
    for entry in filter(str.isdigit, os.listdir("/proc") if engine != "hvdrun" else []):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                program = os.path.basename(f.read().split(b"\0")[0])
        except OSError:
            continue
        if marker.encode() in environ and int(entry) != os.getpid() \
                and (engine != "ray" or program == b"raylet"):
            targets.append(int(entry))
    if not targets:
        sys.exit(f"nothing carrying {marker} to kill on this host")
    with open(os.path.join(folder, "loss"), "w") as f:
        f.write(repr(time.time()))
    for pid in targets:
        os.kill(pid, signal.SIGKILL)
    if engine == "hvdrun":
        write_hosts(folder, ("h1", "h2"))


def write_hosts(folder: str, hosts) -> None:
    """The hvdrun job's discovery output, replaced atomically."""
    path = os.path.join(folder, "hosts")
    with open(path + ".new", "w") as f:
        f.write("".join(f"{host}:1\n" for host in hosts))
    os.replace(path + ".new", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--kill", nargs=3)
    parser.add_argument("--drive", choices=("hvdrun", "ray", "spark"))
    parser.add_argument("--address")
    parser.add_argument("--driver-host")
    parser.add_argument("--jvm-options")
    parser.add_argument("--folders", nargs="*")
    parser.add_argument("--ulfm", action="store_true", help="the job under hvdrun's --ulfm")
    args = parser.parse_args()
    if args.worker:
        train(args.worker)
    elif args.kill:
        kill(*args.kill)
    else:
        {"ray": drive_ray, "spark": drive_spark, "hvdrun": drive_hvdrun}[args.drive](args)


if __name__ == "__main__":
    main()
