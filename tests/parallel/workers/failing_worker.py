"""Rank 1 raises while the other ranks wait in an allreduce; the job must end, not hang."""
import numpy as np

import hvd_trainer as hvd

hvd.init()
hvd.allreduce(np.ones(2), name="warmup")
if hvd.rank() == 1:
    raise ZeroDivisionError("rank 1 fails at step 3")
hvd.allreduce(np.ones(2), name="never completes")
