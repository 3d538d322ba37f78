"""The autotuner's schedule and choice: which reducer setting each of the first steps uses.

With ``HVD_AUTOTUNE=1`` a :class:`~hvd_trainer.training.reducer.Reducer` spends its first steps in
samples of ``HVD_AUTOTUNE_STEPS_PER_SAMPLE`` steps each: first
``HVD_AUTOTUNE_WARMUP_SAMPLES`` samples of the configured setting (discarded: first steps pay
for allocation and caches), then one sample per candidate (a fixed grid of bucket thresholds,
each with overlap off and on). The schedule depends only on the step number, so every rank
switches at the same step. The sample's time is the mean interval between the launches of its
consecutive steps, so forward and backward count; rank 0's measurements decide, and the
reducer sends rank 0's choice to every rank. This module holds no communication: it is the
arithmetic, so it can be tested with made-up times. Its CSV log is opened when the autotuner
is made, so a log that cannot be written says so at the start; it warns once and stops, and
training goes on (hvd_trainer_launch.files.outputs.Output).
"""
import csv
import io
from typing import List, NamedTuple, Optional, Sequence

from hvd_trainer_launch.files.outputs import Output


# The bucket thresholds tried: a fixed grid (no Bayesian optimisation).
THRESHOLDS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
LOG_COLUMNS = ("reducer", "sample", "kind", "bucket_threshold", "overlap", "steps",
               "mean_seconds_per_step")


class Setting(NamedTuple):
    """One point of the search: the bucket threshold in bytes and whether reductions overlap."""

    bucket_threshold: int
    overlap: bool


def candidates(thresholds: Sequence[int], overlaps: Sequence[bool]) -> List[Setting]:
    """Every threshold with every overlap choice, thresholds outermost."""
    return [Setting(t, o) for t in thresholds for o in overlaps]


class Autotuner:
    """The sample schedule over step numbers, the measured samples and the choice.

    ``start`` is the configured setting (used by the warmup samples); the reducer calls
    :meth:`launched` with each step's number and launch time, reads :meth:`setting` for each
    step, and gives :meth:`adopt` the choice it received from rank 0 at :attr:`last_step`.
    """

    def __init__(self, start: Setting, tried: Sequence[Setting], warmup_samples: int,
                 steps_per_sample: int, log_path: Optional[str] = None, name: str = "step"):
        if steps_per_sample < 2:
            raise ValueError(f"HVD_AUTOTUNE_STEPS_PER_SAMPLE={steps_per_sample} must be at "
                             "least 2: a sample is timed between its steps' launches")
        if not tried:
            raise ValueError("the autotuner needs at least one setting to try")
        self.start = Setting(*start)
        self.warmup_samples = int(warmup_samples)
        self.steps_per_sample = int(steps_per_sample)
        self.samples = [self.start] * self.warmup_samples + [Setting(*s) for s in tried]
        self.name = name
        self._log = (Output(log_path, append=True, what="autotune log")
                     if log_path else None)
        if self._log is not None and self._log.was_empty:
            self._write_row(LOG_COLUMNS)
        self.means: List[float] = []        # seconds per step of each finished sample
        self.chosen: Optional[Setting] = None
        self._first_launch: Optional[float] = None

    @property
    def last_step(self) -> int:
        """The number of the last tuning step; the choice holds from the step after it."""
        return len(self.samples) * self.steps_per_sample - 1

    def setting(self, step: int) -> Setting:
        """The setting step number ``step`` uses (the same on every rank)."""
        if step > self.last_step:
            return self.chosen if self.chosen is not None else self.start
        return self.samples[step // self.steps_per_sample]

    def launched(self, step: int, now: float) -> None:
        """Step number ``step`` was launched at ``now`` (seconds); time the samples with it."""
        if step > self.last_step:
            return
        within = step % self.steps_per_sample
        if within == 0:
            self._first_launch = now
        elif within == self.steps_per_sample - 1:
            self.means.append((now - self._first_launch) / (self.steps_per_sample - 1))
            self._log_sample(len(self.means) - 1)

    def best(self) -> Setting:
        """The fastest candidate sample's setting (the first of equals); needs every sample."""
        if len(self.means) != len(self.samples):
            raise RuntimeError(f"the autotuner has timed {len(self.means)} of its "
                               f"{len(self.samples)} samples; it chooses after the last")
        timed = self.means[self.warmup_samples:]
        return self.samples[self.warmup_samples + timed.index(min(timed))]

    def adopt(self, chosen: Sequence) -> Setting:
        """Use ``chosen`` (rank 0's :meth:`best`) from the step after :attr:`last_step`."""
        self.chosen = Setting(int(chosen[0]), bool(chosen[1]))
        self._log_row(len(self.samples), "chosen", self.chosen, "", "")
        if self._log is not None:
            self._log.close()
        return self.chosen

    # -- the CSV log (rank 0 only: the reducer passes a log path there alone) ---------------
    def _log_sample(self, number: int) -> None:
        kind = "warmup" if number < self.warmup_samples else "candidate"
        self._log_row(number, kind, self.samples[number], self.steps_per_sample,
                      f"{self.means[number]:.6g}")

    def _log_row(self, number: int, kind: str, setting: Setting, steps, mean) -> None:
        self._write_row((self.name, number, kind, setting.bucket_threshold,
                         int(setting.overlap), steps, mean))

    def _write_row(self, row: Sequence) -> None:
        """One CSV row, flushed at once (other reducers may append to the same log)."""
        if self._log is None:
            return
        text = io.StringIO()
        csv.writer(text).writerow(row)
        self._log.write(text.getvalue())
        self._log.flush()
