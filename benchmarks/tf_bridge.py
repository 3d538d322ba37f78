"""What the TensorFlow adapter's bridge costs per collective, on 2 ranks in one job:
``hvd_trainer.allreduce`` on a NumPy array vs ``hvd_trainer.tensorflow.allreduce`` on a
tf.Tensor eagerly vs the same inside a ``tf.function`` (a ``tf.numpy_function`` op), 4 KiB to
16 MiB of float32, rounds interleaved, the median of each kept.

    OMP_NUM_THREADS=1 hvdrun -np 2 --no-prefix python benchmarks/tf_bridge.py
"""
import time

import numpy as np
import tensorflow as tf

import hvd_trainer
import hvd_trainer.tensorflow as hvd

ROUNDS, CALLS = 7, 20


def timed(function, argument):
    hvd_trainer.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        function(argument)
    return (time.perf_counter() - start) / CALLS


def main() -> None:
    hvd.init()
    compiled = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))
    if hvd.rank() == 0:
        print(f"TensorFlow {tf.__version__}, {hvd.size()} ranks; median of {ROUNDS} rounds of "
              f"{CALLS} calls, microseconds per allreduce")
        print(f"{'bytes':>10} {'numpy core':>11} {'tf eager':>9} {'tf.function':>12} "
              f"{'eager/core':>11} {'function/core':>14}")
    for size in (1 << 10, 1 << 16, 1 << 20, 1 << 22):
        array = np.ones(size, np.float32)
        tensor = tf.constant(array)
        variants = {
            "core": (lambda a: hvd_trainer.allreduce(a, op=hvd_trainer.Sum), array),
            "eager": (lambda t: hvd.allreduce(t, op=hvd.Sum).numpy(), tensor),
            "function": (lambda t: compiled(t).numpy(), tensor)}
        for function, argument in variants.values():
            function(argument)  # warm up (and trace)
        times = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, (function, argument) in variants.items():
                times[name].append(timed(function, argument))
        med = {name: float(np.median(t)) * 1e6 for name, t in times.items()}
        if hvd.rank() == 0:
            print(f"{size * 4:>10} {med['core']:>11.0f} {med['eager']:>9.0f} "
                  f"{med['function']:>12.0f} {med['eager'] / med['core']:>11.2f} "
                  f"{med['function'] / med['core']:>14.2f}")


if __name__ == "__main__":
    main()
