"""Images per second of a ResNet-style convnet on synthetic images, 1 process vs 2 ranks.

Run:  python benchmarks/synthetic.py [--rounds 2] [--batch-size 32]
Like Horovod's synthetic benchmark: random 3x32x32 images and labels, a ResNet-20-style net
(3 stages of 3 basic residual blocks), SGD with momentum. One process with gluon.Trainer and
2 ranks with DistributedTrainer (through hvdrun) run alternately at the same per-rank batch;
every launch keeps its best repetition and the table keeps each side's best launch.
Scaling efficiency = 2-rank img/s / (2 x 1-process img/s).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

WARMUP, REPETITIONS, STEPS = 3, 3, 10


def residual_net():
    """ResNet-20 for 32x32 inputs: 16/32/64 channels, 3 basic blocks per stage."""
    from mxnet.gluon import nn

    class Block(nn.HybridBlock):
        def __init__(self, channels, stride):
            super().__init__()
            self.body = nn.HybridSequential()
            self.body.add(nn.Conv2D(channels, 3, stride, 1, use_bias=False), nn.BatchNorm(),
                          nn.Activation("relu"), nn.Conv2D(channels, 3, 1, 1, use_bias=False),
                          nn.BatchNorm())
            self.down = (nn.Conv2D(channels, 1, stride, use_bias=False) if stride != 1 else None)

        def hybrid_forward(self, F, x):
            shortcut = self.down(x) if self.down is not None else x
            return F.Activation(self.body(x) + shortcut, act_type="relu")

    net = nn.HybridSequential()
    net.add(nn.Conv2D(16, 3, 1, 1, use_bias=False), nn.BatchNorm(), nn.Activation("relu"))
    for stage, channels in enumerate((16, 32, 64)):
        for block in range(3):
            net.add(Block(channels, 2 if stage and not block else 1))
    net.add(nn.GlobalAvgPool2D(), nn.Dense(10))
    return net


def measure(distributed: bool, batch: int) -> dict:
    """Best images per second (all ranks together) over the repetitions."""
    import mxnet as mx
    import numpy as np
    from mxnet import gluon
    if distributed:
        import hvd_trainer

    net = residual_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    args = (net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})
    trainer = hvd_trainer.DistributedTrainer(*args) if distributed else gluon.Trainer(*args)
    x = mx.nd.random.uniform(shape=(batch, 3, 32, 32))
    y = mx.nd.array(np.random.randint(0, 10, batch))
    ranks = hvd_trainer.size() if distributed else 1
    step = common.training_step(net, trainer, x, y)

    best = common.seconds_per_step(step, STEPS, REPETITIONS, WARMUP, distributed)
    grads = [p.grad() for p in net.collect_params().values() if p.grad_req != "null"]
    return {"img_per_s": batch * ranks / best, "tensors": len(grads),
            "megabytes": sum(g.size * 4 for g in grads) / 1e6,
            "rank0": not distributed or hvd_trainer.rank() == 0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="launches of each side, alternating")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank and step")
    parser.add_argument("--worker", choices=["single", "distributed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = measure(args.worker == "distributed", args.batch_size)
        if result.pop("rank0"):
            common.report(result)
        return

    best = {}
    for _ in range(args.rounds):
        for side, ranks in (("single", 1), ("distributed", 2)):
            r = common.launch(__file__, ranks, ["--worker", side, "--batch-size", str(args.batch_size)])
            if side not in best or r["img_per_s"] > best[side]["img_per_s"]:
                best[side] = r
    one, two = best["single"], best["distributed"]
    print(common.header(f"synthetic ResNet-20, 3x32x32, batch {args.batch_size} per rank",
                        f"OMP_NUM_THREADS=1, best of {args.rounds} launches x {REPETITIONS} "
                        "repetitions"))
    print("| model | tensors | gradients MB | 1 process img/s | 2 ranks img/s | scaling efficiency |")
    print("|---|---|---|---|---|---|")
    print(f"| ResNet-20 | {one['tensors']} | {one['megabytes']:.2f} | {one['img_per_s']:.0f} | "
          f"{two['img_per_s']:.0f} | {two['img_per_s'] / (2 * one['img_per_s']):.2f} |")


if __name__ == "__main__":
    main()
