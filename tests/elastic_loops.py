"""The elastic training that the elastic engine tests run on their ranks (tests/parallel's
engine-less job, tests/engines' Ray job), its one-process replay, and the notes its rank 0
leaves in a progress file. It travels to the ranks by value (the ranks need not import it).

Each step the ranks' gradients (rank + 1) * (step + 1) are summed and w = w / 2 + sum, so the
weights depend on the number of ranks at every step: the replay of the committed steps' sizes
in one process is the reference. The training ends once it has run GROWN_STEPS steps grown
back after a loss (or at a limit of steps): a test waits for the loss and the return, not for
a fixed number of paced steps. At each life's start rank 0 notes ``start STEP SIZE`` and the
last rank ``last ACTOR_PID HOST`` (its agent's process: owned_folders names the maker of its
commits folder; its host: the engine's name in hvdrun's agent name), and rank 0 ``pid PID
SIZE`` (the same process across a change in place); after each commit rank 0 notes ``commit
STEP``."""
import os
import sys
import time

import cloudpickle
import numpy as np

cloudpickle.register_pickle_by_value(sys.modules[__name__])
# Steps the job runs once grown back: enough that the regrown life's sums count (the weights
# depend on the size at each step).
GROWN_STEPS = 4


def train(limit, progress, pause=0.25):
    """The training on a rank, until it has grown back (see :func:`grown_back`) or done
    ``limit`` steps; returns (weights, the size at each committed step)."""
    import json
    import os
    import time
    import numpy as np
    import hvd_trainer as hvd
    from hvd_trainer import elastic as hvd_elastic
    hvd.init()
    state = hvd_elastic.ObjectState(w=np.zeros(3), step=0, sizes=[])

    def note(text, rank=0):
        if hvd.rank() == rank:
            with open(progress, "a") as file:
                file.write(text + "\n")

    @hvd_elastic.run
    def loop(state):
        note(f"start {state.step} {hvd.size()}")
        note(f"pid {os.getpid()} {hvd.size()}")
        actor = os.path.basename(os.environ["HVD_ELASTIC_DIR"]).split("-")[1]
        agent = json.loads(os.environ["HVDRUN_HOSTS"])[-1][0]
        note(f"last {actor} {agent.split('-', 2)[2]}", hvd.size() - 1)
        while state.step < limit and grown_back(state.sizes) < GROWN_STEPS:
            grad = hvd.allreduce(np.full(3, hvd.rank() + 1.0) * (state.step + 1), op=hvd.Sum)
            state.w = state.w / 2 + grad
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()
            note(f"commit {state.step}")
            time.sleep(pause)
    loop(state)
    return state.w, state.sizes


def grown_back(sizes):
    """The steps done on the most ranks so far since a step on fewer that came after one on
    the most (0 before such a loss): how long the job has run grown back. Every rank computes
    it from the committed sizes, so the ranks agree on when to end without a message."""
    most = max(sizes, default=0)
    fewer = [index for index in range(len(sizes)) if sizes[index] < most
             and most in sizes[:index]]
    return len(sizes) - fewer[-1] - 1 if fewer else 0


def replay(sizes):
    """The weights after the committed steps, in one process: n ranks sum n (n + 1) / 2."""
    w = np.zeros(3)
    for step, n in enumerate(sizes):
        w = w / 2 + n * (n + 1) / 2 * (step + 1)
    return w


def notes(path, word):
    """The notes that start with ``word``, each as its other words."""
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [line.split()[1:] for line in file if line.startswith(word)]


def commits_on_three(path):
    """The commits since the newest life on three ranks began (0 before there is one): its
    last rank has noted where it runs by then."""
    if not os.path.exists(path):
        return 0
    with open(path) as file:
        lines = file.read().splitlines()
    starts = [index for index, line in enumerate(lines)
              if line.startswith("start") and line.endswith(" 3")]
    return sum(line.startswith("commit") for line in lines[starts[-1]:]) if starts else 0


def check(results, progress, seen, grew_in_place):
    """A job that lost a host after commit ``seen`` and got it back: grown back to three
    ranks for GROWN_STEPS steps, the life after the loss starting at or after ``seen`` (no
    commit lost), every step committed once, the weights equal to the replay, the same on
    every rank; rank 0 went on in its process from two ranks to three if ``grew_in_place``,
    else it restarted."""
    (w, sizes), *others = results
    pids = [(pid, int(size)) for pid, size in notes(progress, "pid")]
    regrown = [size for _, size in pids].index(3, [size for _, size in pids].index(2))
    assert (pids[regrown][0] == pids[regrown - 1][0]) == grew_in_place, pids
    assert len(results) == 3
    starts = [(int(step), int(size)) for step, size in notes(progress, "start")]
    after = starts[[size for _, size in starts].index(3):]  # from the first life on three
    shrunk = [step for step, size in after if size == 2]
    assert starts[0][0] == 0 and shrunk and shrunk[0] >= seen
    assert len(sizes) == int(notes(progress, "commit")[-1][0]) and 2 in sizes
    assert sizes[-GROWN_STEPS:] == [3] * GROWN_STEPS, sizes
    np.testing.assert_allclose(w, replay(sizes))
    for other_w, other_sizes in others:
        np.testing.assert_array_equal(other_w, w)
        assert other_sizes == sizes


def wait(condition, seconds=180):
    """Wait until ``condition()``; AssertionError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
