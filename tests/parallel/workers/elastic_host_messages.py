"""Elastic worker without a framework: rank 0 waits for hvdrun's host-change notice by polling
``state._host_messages.empty()``, as Horovod's own elastic test scripts do, and the commit
right after it must restart the job on the new hosts.

Usage: elastic_host_messages.py HOSTS_FILE NEW_HOSTS. Rank 0 prints ``LIFE size=S step=K`` at
each start, ``EMPTY before=B`` (what empty() says before the hosts file changes) and
``NOTICE step=K`` once empty() is False; ``NO INTERRUPT`` when the commit after the notice did
not restart the job.
"""
import os
import sys
import time

import hvd_trainer as hvd
from hvd_trainer import elastic

STEPS, CHANGE_AT = 6, 2
hosts_file, new_hosts = sys.argv[1], sys.argv[2]


@elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"LIFE size={hvd.size()} step={state.step}", flush=True)
    while state.step < STEPS:
        state.step += 1
        state.commit()
        if state.step == CHANGE_AT and not state.changed:
            if hvd.rank() == 0:
                print(f"EMPTY before={state._host_messages.empty()}", flush=True)
                with open(hosts_file + ".tmp", "w") as f:
                    f.write(new_hosts + "\n")
                os.replace(hosts_file + ".tmp", hosts_file)
                deadline = time.monotonic() + 30
                while state._host_messages.empty():
                    if time.monotonic() > deadline:
                        raise TimeoutError("no notice from hvdrun within 30 s")
                    time.sleep(0.1)
                print(f"NOTICE step={state.step}", flush=True)
            state.changed = True
            state.commit()  # HostsUpdatedInterrupt here: the next life starts at this step
            if hvd.rank() == 0:
                print("NO INTERRUPT", flush=True)


train(elastic.ObjectState(step=0, changed=False))
