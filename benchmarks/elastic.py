"""What elasticity costs: a commit, in ms per MB of state, and the time from a rank's death
to the first training step after recovery.

Run:  python benchmarks/elastic.py [--rounds 3] [--framework mxnet|torch]

Commit: 2 ranks under elastic hvdrun, a GluonState of one Dense layer (``--framework torch``:
a TorchState of one Linear layer and a DistributedOptimizer) with W MiB of weights and SGD
momentum (a state of about 2W MiB), W = 2, 8, 32; median of 7 commits each, split into the
snapshot (weights and optimizer states out of the framework, pickled) and the write (file,
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
from common import header, slowest_rank  # noqa: E402

SIZES_MIB = (2, 8, 32)


def gluon_state(mib: int, prefix: str, **attributes):
    """A Dense layer of ``mib`` MiB of weights (``mib`` 0: a small one) under a
    DistributedTrainer with SGD momentum after one step, its GluonState, and a training
    step."""
    import mxnet as mx

    import hvd_trainer.mxnet as hvd
    rows, cols = (256 * mib, 1024) if mib else (100, 10)
    net = mx.gluon.nn.Dense(cols, in_units=rows, use_bias=False)
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.01, "momentum": 0.9}, prefix=prefix)
    x = mx.nd.ones((8, rows))

    def step() -> None:
        with mx.autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(8)
        mx.nd.waitall()

    step()  # creates the momentum states
    return hvd.elastic.GluonState(net, trainer, **attributes), step


def torch_state(mib: int, prefix: str, **attributes):
    """The same with a torch Linear layer, a DistributedOptimizer and TorchState."""
    import torch

    import hvd_trainer.torch as hvd
    rows, cols = (256 * mib, 1024) if mib else (100, 10)
    model = torch.nn.Linear(rows, cols, bias=False)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=[(f"{prefix}{name}", p) for name, p in model.named_parameters()])
    x = torch.ones(8, rows)

    def step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    step()
    return hvd.elastic.TorchState(model, optimizer, **attributes), step


STATES = {"mxnet": gluon_state, "torch": torch_state}


def commit_worker(framework: str) -> None:
    import hvd_trainer
    from hvd_trainer import runtime
    rows = []
    for mib in SIZES_MIB:
        state, _ = STATES[framework](mib, f"w{mib}.", epoch=0)
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
        worst = [slowest_rank(statistics.median(t), True) for t in (totals, snapshots, writes)]
        rows.append({"mib": len(data) / 2**20, "commit": worst[0], "snapshot": worst[1],
                     "write": worst[2]})
    if runtime.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def recovery_worker(framework: str, folder: str) -> None:
    import hvd_trainer
    from hvd_trainer import elastic
    life = os.environ["HVD_ELASTIC_RESTART"]
    state, step = STATES[framework](0, "", step=0)

    @elastic.run
    def train(state):
        if life != "0" and hvd_trainer.rank() == 0:
            restored = time.time()
        while state.step < 200:
            if life == "0" and hvd_trainer.rank() == 1 and state.step == 10:
                with open(os.path.join(folder, "death"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            step()
            state.step += 1
            if life != "0":
                if hvd_trainer.rank() == 0:
                    with open(os.path.join(folder, "first"), "w") as f:
                        json.dump({"started": STARTED, "restored": restored,
                                   "first_step": time.time()}, f)
                return
            state.commit()
    train(state)


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
    parser.add_argument("--framework", choices=sorted(STATES), default="mxnet")
    parser.add_argument("--worker", nargs="*")
    options = parser.parse_args()
    framework = options.framework
    if options.worker is not None:
        if options.worker[0] == "commit":
            commit_worker(framework)
        else:
            recovery_worker(framework, options.worker[1])
        return
    kind = {"mxnet": "GluonState", "torch": "TorchState"}[framework]
    print(header(f"Elastic commit cost (2 ranks, {kind}, median of 7, slowest rank)"))
    rows = json.loads(re.search(r"RESULT (.*)", run_hvdrun(
        [], ["--framework", framework, "--worker", "commit"]))[1])
    print("| state MiB | commit ms | ms per MiB | snapshot ms | write+fsync ms |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['mib']:.1f} | {row['commit'] * 1e3:.1f} | "
              f"{row['commit'] * 1e3 / row['mib']:.2f} | {row['snapshot'] * 1e3:.1f} | "
              f"{row['write'] * 1e3:.1f} |")
    print()
    print(header(f"Elastic recovery (2 ranks, {kind}, rank 1 SIGKILLed, restart on 2)"))
    print("| round | death -> new ranks run Python s | -> restored s | -> first step s |")
    print("|---|---|---|---|")
    totals = []
    for number in range(options.rounds):
        with tempfile.TemporaryDirectory() as folder:
            run_hvdrun([], ["--framework", framework, "--worker", "recover", folder])
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
