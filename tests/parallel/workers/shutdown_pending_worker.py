"""Rank 1 leaves a named async allreduce that no other rank makes, then every rank meets in a
barrier, shuts down and initialises again (a test's tearDown, then the next test's setUp in
Horovod's suites) and meets in a second barrier. Each rank prints ``reached <step>``."""
import torch

import hvd_trainer.torch as hvd

hvd.init()
rank = hvd.rank()
if rank == 1:
    hvd.allreduce_async(torch.ones(17), name="left.pending")
hvd.barrier()
print(f"rank {rank} reached first barrier", flush=True)
hvd.shutdown()
hvd.init()
hvd.barrier()
print(f"rank {rank} reached second barrier", flush=True)
hvd.shutdown()
print(f"rank {rank} reached end", flush=True)
