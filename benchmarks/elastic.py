"""What elasticity costs: a commit, in ms per MB of state, and the time from a rank's death
to the first training step after recovery.

Run:  python benchmarks/elastic.py [--rounds 3]

Commit: 2 ranks under elastic hvdrun, a GluonState of one Dense layer with W MiB of weights
and SGD momentum (a state of about 2W MiB), W = 2, 8, 32; median of 7 commits each, split
into the snapshot (weights and optimizer states out of MXNet, pickled) and the write (file,
fsync, rename) and the host check. Recovery: 2 ranks commit after every step; on the first
life rank 1 writes the time and SIGKILLs itself; the second life's rank 0 writes the time
after its first step. Reported per round: death -> the new ranks' first line of Python ->
restored -> first step done.
"""
import argparse
import json
import os
import pickle
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

STARTED = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import header  # noqa: E402

SIZES_MIB = (2, 8, 32)


def commit_worker() -> None:
    import mxnet as mx

    import hvd_trainer
    import hvd_trainer.mxnet as hvd
    from hvd_trainer import runtime
    rows = []
    for mib in SIZES_MIB:
        net = mx.gluon.nn.Dense(1024, in_units=256 * mib, use_bias=False)
        net.initialize()
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                         {"learning_rate": 0.01, "momentum": 0.9},
                                         prefix=f"w{mib}.")
        with mx.autograd.record():
            loss = net(mx.nd.ones((1, 256 * mib))).sum()
        loss.backward()
        trainer.step(1)  # creates the momentum states
        state = hvd.elastic.GluonState(net, trainer, epoch=0)
        totals, snapshots, writes = [], [], []
        for _ in range(7):
            hvd_trainer.barrier()
            start = time.perf_counter()
            state.commit()
            totals.append(time.perf_counter() - start)
            start = time.perf_counter()
            data = pickle.dumps(state.save(), pickle.HIGHEST_PROTOCOL)
            snapshots.append(time.perf_counter() - start)
            start = time.perf_counter()
            state._store.write(runtime.rank(), 10**6, data)
            writes.append(time.perf_counter() - start)
        worst = [float(hvd.allreduce(mx.nd.array([statistics.median(t)]), op=hvd.Max)
                       .asscalar()) for t in (totals, snapshots, writes)]
        rows.append({"mib": len(data) / 2**20, "commit": worst[0], "snapshot": worst[1],
                     "write": worst[2]})
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def recovery_worker(folder: str) -> None:
    import mxnet as mx

    import hvd_trainer.mxnet as hvd
    life = os.environ["HVD_ELASTIC_RESTART"]
    net = mx.gluon.nn.Dense(10, in_units=100)
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
    x = mx.nd.ones((8, 100))

    @hvd.elastic.run
    def train(state):
        if life != "0" and hvd.rank() == 0:
            restored = time.time()
        while state.step < 200:
            if life == "0" and hvd.rank() == 1 and state.step == 10:
                with open(os.path.join(folder, "death"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            with mx.autograd.record():
                loss = net(x).sum()
            loss.backward()
            trainer.step(8)
            mx.nd.waitall()
            state.step += 1
            if life != "0":
                if hvd.rank() == 0:
                    with open(os.path.join(folder, "first"), "w") as f:
                        json.dump({"started": STARTED, "restored": restored,
                                   "first_step": time.time()}, f)
                return
            state.commit()
    train(hvd.elastic.GluonState(net, trainer, step=0))


def run_hvdrun(args, worker_args, env=None) -> str:
    cmd = [sys.executable, "-m", "hvd_trainer_launch.hvdrun", "-np", "2", "--min-np", "2",
           "--no-prefix", *args, sys.executable, os.path.abspath(__file__), *worker_args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    out = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs="*")
    options = parser.parse_args()
    if options.worker is not None:
        if options.worker[0] == "commit":
            commit_worker()
        else:
            recovery_worker(options.worker[1])
        return
    print(header("Elastic commit cost (2 ranks, GluonState, median of 7, slowest rank)"))
    rows = json.loads(re.search(r"RESULT (.*)", run_hvdrun([], ["--worker", "commit"]))[1])
    print("| state MiB | commit ms | ms per MiB | snapshot ms | write+fsync ms |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['mib']:.1f} | {row['commit'] * 1e3:.1f} | "
              f"{row['commit'] * 1e3 / row['mib']:.2f} | {row['snapshot'] * 1e3:.1f} | "
              f"{row['write'] * 1e3:.1f} |")
    print()
    print(header("Elastic recovery (2 ranks, rank 1 SIGKILLed, restart on 2)"))
    print("| round | death -> new ranks run Python s | -> restored s | -> first step s |")
    print("|---|---|---|---|")
    totals = []
    for number in range(options.rounds):
        with tempfile.TemporaryDirectory() as folder:
            run_hvdrun([], ["--worker", "recover", folder])
            with open(os.path.join(folder, "death")) as f:
                death = float(f.read())
            with open(os.path.join(folder, "first")) as f:
                times = json.load(f)
        totals.append(times["first_step"] - death)
        print(f"| {number + 1} | {times['started'] - death:.2f} | "
              f"{times['restored'] - death:.2f} | {times['first_step'] - death:.2f} |")
    print(f"\nmedian death -> first step after recovery: {statistics.median(totals):.2f} s")


if __name__ == "__main__":
    main()
