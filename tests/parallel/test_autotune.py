"""HVD_AUTOTUNE=1 on 3 ranks: every rank switches settings at the same steps, ends on
rank 0's fastest sample, trains as one gluon.Trainer on the global batch, and rank 0 logs one
row per sample (worker: workers/autotune_trainer.py)."""
import pytest

from runner import case_job


@pytest.mark.parametrize("np_", [3])
def test_ranks_adopt_rank_0s_choice_and_train_as_one_process(tmp_path, np_):
    log = tmp_path / "autotune.csv"
    env = {"HVD_AUTOTUNE": "1", "HVD_AUTOTUNE_WARMUP_SAMPLES": "1",
           "HVD_AUTOTUNE_STEPS_PER_SAMPLE": "2", "HVD_AUTOTUNE_LOG": str(log)}
    case_job("autotune_trainer.py", np_, [str(log)], timeout=240, env=env).check(
        "autotuned_training")


@pytest.mark.parametrize("np_", [3])
def test_torch_optimizer_backs_the_buckets_each_autotuned_layout(np_):
    env = {"HVD_AUTOTUNE": "1", "HVD_AUTOTUNE_WARMUP_SAMPLES": "1",
           "HVD_AUTOTUNE_STEPS_PER_SAMPLE": "2"}
    case_job("torch_autotune_optimizer.py", np_, timeout=240, env=env).check(
        "autotuned_training")
