"""Ranks whose graphs hold collectives of different names: rank 0's allreduce 'only on rank
0', the others' 'not on rank 0', in a TF1 session or a tf.function (the argument: session or
function). A graph's op waits for its match, as in Horovod (where every rank waits in a graph
it is not a waited call, see matching.deadlocked), so no rank raises a mismatch: the stall
inspector must name the calls and end the job (HVD_STALL_SHUTDOWN_TIME_SECONDS)."""
import sys

import numpy as np
import tensorflow as tf

import hvd_trainer.tensorflow as hvd

hvd.init()
name = "only on rank 0" if hvd.rank() == 0 else "not on rank 0"
if sys.argv[1] == "session":
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        session.run(hvd.allreduce(tf.constant(np.ones(3, np.float32)), name=name))
else:
    tf.function(lambda x: hvd.allreduce(x, name=name))(tf.constant(np.ones(3, np.float32)))
print("finished", flush=True)
