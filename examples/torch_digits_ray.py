"""torch_digits.py on a Ray cluster: the same training function, started on Ray's workers by
hvd_trainer.ray.RayExecutor (horovod.ray's API) instead of hvdrun, with no ssh.

    python examples/torch_digits_ray.py --workers 3            # a Ray instance of its own
    python examples/torch_digits_ray.py --address HEAD:6379    # an existing cluster

Each worker needs one CPU; MPICH's mpiexec and this Python must exist at the same paths on
every node. Prints rank 0's epochs and every rank's final test accuracy.
"""
import argparse

import cloudpickle
import ray

import torch_digits
from hvd_trainer.ray import RayExecutor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running Ray cluster (default: start one here)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=25)
    args = parser.parse_args()
    # The training function travels by value, so the workers need not see this folder.
    cloudpickle.register_pickle_by_value(torch_digits)
    ray.init(address=args.address) if args.address else ray.init(num_cpus=args.workers)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.workers)
    executor.start()
    try:
        accuracies = executor.run(torch_digits.train, kwargs={"epochs": args.epochs})
    finally:
        executor.shutdown()
    print("test accuracy per rank:", " ".join(f"{a:.4f}" for a in accuracies))


if __name__ == "__main__":
    main()
