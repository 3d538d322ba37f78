"""Elastic worker whose rank 1 fails on every life (HorovodInternalError), for --reset-limit.

Rank 0 prints ``LIFE restart=R`` at each start.
"""
import os

import hvd_trainer as hvd
from hvd_trainer import elastic


@elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"LIFE restart={os.environ['HVD_ELASTIC_RESTART']}", flush=True)
    state.commit()
    if hvd.rank() == 1:
        raise elastic.HorovodInternalError("rank 1 lost its peer (simulated)")
    hvd.barrier()


train(elastic.ObjectState(step=0))
