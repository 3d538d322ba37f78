"""Ranks whose TF1 graphs hold collectives of different names: rank 0's allreduce 'only on
rank 0', the others' 'not on rank 0'. A graph's op waits for its match, as in Horovod (it is
not a waited call, see scheduler.start), so no rank raises a mismatch: the stall inspector
must name the calls and end the job (HVD_STALL_SHUTDOWN_TIME_SECONDS)."""
import numpy as np
import tensorflow as tf

import hvd_trainer.tensorflow as hvd

hvd.init()
name = "only on rank 0" if hvd.rank() == 0 else "not on rank 0"
with tf.Graph().as_default(), tf.compat.v1.Session() as session:
    session.run(hvd.allreduce(tf.constant(np.ones(3, np.float32)), name=name))
print("finished", flush=True)
