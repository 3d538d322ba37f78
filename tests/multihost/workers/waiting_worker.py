"""A rank that says where it runs, then allreduces in a loop until it is killed.

Run as: waiting_worker.py FOLDER. Each rank writes FOLDER/ready.RANK with its hostname and
its process id as seen on its host (so a test can kill it there), after the first allreduce.
"""
import os
import socket
import sys
import time

import numpy as np

import hvd_trainer as hvd

hvd.init()
hvd.allreduce(np.ones(10, np.float32), name="first")
path = os.path.join(sys.argv[1], f"ready.{hvd.rank()}")
with open(path + ".tmp", "w") as f:
    f.write(f"{socket.gethostname()} {os.getpid()}\n")
os.replace(path + ".tmp", path)
while True:
    hvd.allreduce(np.ones(1000, np.float32), name="again")
    time.sleep(0.05)
