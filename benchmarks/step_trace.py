"""Probe: per-phase timestamps of one torch step on each rank (not a benchmark yet).

Run: python benchmarks/step_trace.py --bed 1gbit [--codecs none fp16]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

EVENTS = []


def rec(what, start, end, **extra):
    EVENTS.append(dict(what=what, t0=start, t1=end, th=__import__("threading").current_thread().name[:12], **extra))


def wrap(owner, attr, label, info=None):
    original = getattr(owner, attr)

    def wrapped(*a, **k):
        tic = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            rec(label, tic, time.perf_counter(), **(info(*a, **k) if info else {}))
    setattr(owner, attr, wrapped)


def instrument():
    from hvd_trainer.backends import mpi
    from hvd_trainer.coordination import agreement
    from hvd_trainer.training import program, step as stepmod
    C = mpi.MPICommunicator
    wrap(C, "_sendrecv", "sendrecv", lambda self, send, *a, **k: {"n": int(send.nbytes)})
    wrap(C, "allgatherv", "allgatherv", lambda self, send, *a, **k: {"n": int(send.nbytes)})
    wrap(C, "allreduce", "comm.allreduce", lambda self, buf, *a, **k: {"n": int(buf.nbytes)})
    wrap(agreement, "meet", "meet")
    wrap(agreement, "agree", "agree")
    wrap(program, "_call", "hook", lambda reducer, b: {"n": int(b.buffer.nbytes), "b": b.index})
    wrap(stepmod.Step, "wait_for_bucket", "wait_bucket", lambda self, n: {"b": n})
    orig_mark = stepmod.Step.mark

    def mark(self, position, value=None):
        done = orig_mark(self, position, value)
        if done:
            t = time.perf_counter()
            rec("bucket_ready", t, t, p=position)
        return done
    stepmod.Step.mark = mark
    orig_reduced = stepmod.Step.reduced

    def reduced(self, number, array):
        t = time.perf_counter()
        rec("reduced", t, t, b=number)
        return orig_reduced(self, number, array)
    stepmod.Step.reduced = reduced
    from hvd_trainer.torch import compression as tc
    k = tc.KERNELS
    for name in ("narrow", "widen", "add"):
        if hasattr(k, name):
            f = getattr(k, name)

            def timed(*a, _f=f, _n=name, **kw):
                tic = time.perf_counter()
                r = _f(*a, **kw)
                rec(_n, tic, time.perf_counter())
                return r
            try:
                object.__setattr__(k, name, timed)
            except Exception as e:
                print("cannot wrap", name, e, file=sys.stderr)


def worker(codecs):
    import torch
    import hvd_trainer
    import hvd_trainer.torch as hvd
    import compressed_step as cs
    instrument()
    torch.set_num_threads(1)
    hvd.init()
    out = {}
    for name in codecs:
        torch.manual_seed(0)
        layers = []
        for _ in range(cs.LAYERS):
            layers += [torch.nn.Linear(cs.WIDTH, cs.WIDTH), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(cs.WIDTH, 10))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=[(f"{name}.{n}", p) for n, p in net.named_parameters()],
                                       compression=cs.compressor(name))
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        x, y = torch.rand(cs.BATCH, cs.WIDTH), torch.randint(0, 10, (cs.BATCH,))
        steps = []
        for i in range(7):
            hvd.barrier()
            EVENTS.clear()
            c0 = time.process_time()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.synchronize()
            t3 = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
            t4 = time.perf_counter()
            steps.append(dict(t0=t0, fwd=t1, bwd=t2, sync=t3, end=t4, cpu=time.process_time() - c0,
                              events=list(EVENTS)))
        mine = steps[3:]
        out[name] = mine
    gathered = hvd_trainer.allgather_object(out) if hasattr(hvd_trainer, "allgather_object") else [out]
    if hvd.rank() == 0:
        with open(os.environ["TRACE_OUT"], "w") as f:
            json.dump({"imported": hvd_trainer.__file__, "ranks": gathered}, f)
        print("RESULT " + json.dumps({"imported": hvd_trainer.__file__}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bed", default="1gbit")
    p.add_argument("--codecs", nargs="+", default=["none", "fp16"])
    p.add_argument("--out", default="/var/tmp/step_trace")
    p.add_argument("--worker", nargs="+")
    p.add_argument("--env", nargs="*", default=[])
    p.add_argument("--against")
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return
    import slow_link
    repo = os.path.dirname(HERE)
    env = {"PYTHONPATH": repo, "TRACE_OUT": a.out}
    for kv in a.env:
        k, v = kv.split("=", 1)
        env[k] = v
    import tempfile
    from common import extract_tree
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="trace.") as old:
        trees = {"new": repo}
        if a.against:
            extract_tree(a.against, old)
            trees["old"] = old
        with slow_link.two_hosts("step_trace") as bed:
            slow_link.shape(bed, a.bed, 0.0)
            for label, tree in trees.items():
                env.update(PYTHONPATH=tree, TRACE_OUT=f"{a.out}.{label}.json")
                r = slow_link.bed_result(bed, ["-np", "2", "-H", "h1:1,h2:1"], __file__, a.codecs,
                                         env, "trace")
                print("wrote", label, r, os.getloadavg())


if __name__ == "__main__":
    main()
