"""hvd_trainer.torch.elastic in a one-process world: the torch ElasticSampler's split over
ranks against hand-made expectations and the DataLoader's own batches, and TorchState's
commit and restore against a plain replay (momentum included) and across a new process."""
import warnings

import pytest
import torch

import hvd_trainer.torch as hvd
from hvd_trainer import elastic as core
from hvd_trainer.runtime import runtime
from hvd_trainer_launch import protocol


@pytest.fixture(autouse=True, scope="module")
def world():
    hvd.init()


def as_rank(monkeypatch, rank, size):
    """Make the sampler see this process as rank ``rank`` of ``size``."""
    monkeypatch.setattr(runtime, "rank", lambda: rank)
    monkeypatch.setattr(runtime, "size", lambda: size)


def numbered(n):
    """A dataset whose sample i is the number i."""
    return torch.utils.data.TensorDataset(torch.arange(n))


def loader_batches(sampler, batch_size):
    loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=batch_size, sampler=sampler)
    return [batch.tolist() for (batch,) in loader]


def first_batches_on_each_rank(monkeypatch, make, size, batch_size, count):
    """Each of ``size`` ranks iterates its own sampler from ``make()`` through a DataLoader
    and records its first ``count`` batches; returns every rank's batches and a sampler
    holding the merged record (what a commit holds)."""
    merged, every = make(), []
    for rank in range(size):
        as_rank(monkeypatch, rank, size)
        sampler = make()
        batches = loader_batches(sampler, batch_size)
        for position in range(count):
            assert sampler.get_indices(position, batch_size) == batches[position]
            sampler.record_batch(position, batch_size)
            merged.record_indices(batches[position])
        every.append(batches)
    return every, merged


def test_sampler_spreads_the_samples_left_over_the_new_ranks_by_hand(monkeypatch):
    def make():
        return hvd.elastic.ElasticSampler(numbered(10), shuffle=False)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 10 samples on 3 ranks: every rank has 2 batches
        every, merged = first_batches_on_each_rank(monkeypatch, make, 3, 2, 1)
    # 3 ranks: rank r takes every third sample from the r-th.
    assert every == [[[0, 3], [6, 9]], [[1, 4], [7]], [[2, 5], [8]]]
    # Restarted on 2 ranks (a new process loads the committed record): 6..9 are left.
    again = make()
    again.load_state_dict(merged.state_dict())
    for rank, mine in ((0, [6, 8]), (1, [7, 9])):
        as_rank(monkeypatch, rank, 2)
        assert list(again) == mine and len(again) == 2


@pytest.mark.filterwarnings("ignore:ElasticSampler.*one more batch:RuntimeWarning")
@pytest.mark.parametrize("size, batch_size, done_batches", [(3, 4, 2), (2, 3, 1), (4, 1, 5)])
def test_shuffled_split_covers_what_is_left_once_after_a_change_of_size(
        monkeypatch, size, batch_size, done_batches):
    def make():
        return hvd.elastic.ElasticSampler(numbered(50), shuffle=True, seed=9)

    every, merged = first_batches_on_each_rank(monkeypatch, make, size, batch_size,
                                               done_batches)
    done = [i for batches in every for batch in batches[:done_batches] for i in batch]
    assert len(set(done)) == len(done) == size * batch_size * done_batches
    for new_size in (size - 1, size + 1):
        seen = []
        for rank in range(new_size):
            as_rank(monkeypatch, rank, new_size)
            seen += list(merged)
        assert sorted(seen) == sorted(set(range(50)) - set(done))


def test_core_batch_sampler_evens_out_what_the_torch_sampler_cannot(monkeypatch):
    # 7 samples, 3 ranks, batches of 2: 7 = 1 * 3 * 2 + 1. The torch sampler (no repeats)
    # gives rank 0 a second batch of one sample; the core batch sampler, as a DataLoader's
    # batch_sampler, puts that sample into rank 0's only batch (as docs/elastic.md says).
    dataset = numbered(7)
    torch_batches, core_batches = [], []
    for rank in range(3):
        as_rank(monkeypatch, rank, 3)
        torch_batches.append(loader_batches(
            hvd.elastic.ElasticSampler(dataset, shuffle=False), 2))
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=core.ElasticSampler(len(dataset), 2, shuffle=False))
        core_batches.append([batch.tolist() for (batch,) in loader])
    assert torch_batches == [[[0, 3], [6]], [[1, 4]], [[2, 5]]]
    assert core_batches == [[[0, 3, 6]], [[1, 4]], [[2, 5]]]
    # Every rank's first record_batch says so, with the fix.
    for rank in range(3):
        as_rank(monkeypatch, rank, 3)
        sampler = hvd.elastic.ElasticSampler(dataset, shuffle=False)
        list(sampler)
        with pytest.warns(RuntimeWarning, match=r"ranks 0 to 0 get one more batch.*"
                          r"ElasticSampler\(len\(dataset\), 2\) as the DataLoader's "
                          "batch_sampler"):
            sampler.record_batch(0, 2)


def test_set_epoch_clears_the_record_and_changes_the_order():
    sampler = hvd.elastic.ElasticSampler(numbered(20), shuffle=True, seed=1)
    first = list(sampler)
    sampler.record_indices(first[:5])
    assert len(sampler) == 15
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(20)) and second != first


def test_get_indices_names_what_is_wrong():
    sampler = hvd.elastic.ElasticSampler(numbered(5), shuffle=False)
    with pytest.raises(ValueError, match="no iteration has started"):
        sampler.record_batch(0, 2)
    list(sampler)
    assert sampler.get_indices(2, 2) == [4]
    with pytest.raises(ValueError, match="has 5 samples on this rank"):
        sampler.get_indices(3, 2)


def model_and_batches():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    batches = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(5)]
    return model, batches


def train_step(model, optimizer, batch):
    x, y = batch
    optimizer.zero_grad()
    ((model(x) - y) ** 2).sum().backward()
    optimizer.step()


def test_restore_goes_back_to_the_weights_and_momentum_of_the_commit():
    model, batches = model_and_batches()
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    reference.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, batch=0)
    state.sync()
    for state.batch in (0, 1):
        train_step(model, optimizer, batches[state.batch])
    state.batch = 2
    state.commit()
    for batch in batches[3:5]:  # work after the commit, lost by the restore
        train_step(model, optimizer, batch)
    state.restore()
    assert state.batch == 2 and state.model is model and state.optimizer is optimizer
    train_step(model, optimizer, batches[2])
    # The replay: the same batches, without the lost ones, on a plain optimizer.
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for batch in batches[:3]:
        train_step(reference, plain, batch)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_new_process_recovers_model_optimizer_scheduler_sampler_and_attributes(
        tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ELASTIC_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv(protocol.SECRET_VARIABLE, "the job's secret")

    def build():
        model, batches = model_and_batches()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        sampler = hvd.elastic.ElasticSampler(numbered(10), shuffle=False)
        state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, sampler=sampler,
                                       epoch=0)
        return state, batches

    state, batches = build()
    state.recover()
    for batch in batches[:2]:
        train_step(state.model, state.optimizer, batch)
        state.scheduler.step()
    list(state.sampler)
    state.sampler.record_batch(0, 3)
    state.epoch = 4
    state.commit()
    weights = [p.detach().clone() for p in state.model.parameters()]
    momenta = [state.optimizer.state[p]["momentum_buffer"].clone()
               for p in state.model.parameters()]

    fresh, _ = build()
    fresh.recover()
    assert fresh.epoch == 4 and fresh.scheduler.last_epoch == 2
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    for param, weight, momentum in zip(fresh.model.parameters(), weights, momenta):
        torch.testing.assert_close(param.detach(), weight, rtol=0, atol=0)
        torch.testing.assert_close(fresh.optimizer.state[param]["momentum_buffer"], momentum,
                                   rtol=0, atol=0)
    assert list(fresh.sampler) == [3, 4, 5, 6, 7, 8, 9]


def test_horovod_names_are_the_elastic_core_s():
    assert hvd.elastic.run is core.run and hvd.elastic.State is core.State
    assert hvd.elastic.ObjectState is core.ObjectState
    assert hvd.elastic.HostsUpdatedInterrupt is core.HostsUpdatedInterrupt
    assert hvd.HorovodInternalError is hvd.elastic.HorovodInternalError \
        is core.HorovodInternalError
    assert isinstance(hvd.elastic.ElasticSampler(numbered(3)), torch.utils.data.Sampler)


def test_tensors_of_every_dtype_come_back_exactly_from_memory_and_from_disk(
        tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ELASTIC_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv(protocol.SECRET_VARIABLE, "the job's secret")
    torch.manual_seed(4)
    base = torch.randn(6, 8)
    tensors = {"bfloat16": base.bfloat16(), "float16": base.half(), "float64": base.double(),
               "int64": (base * 100).long(), "bool": base > 0, "complex": torch.complex(
                   base[:3], base[3:]), "scalar": torch.tensor(3.5), "strided": base.t()[::3],
               "leaf": torch.ones(3, requires_grad=True), "empty": torch.zeros(0, 2),
               "sparse": base.relu().to_sparse()}
    reference = {name: tensor.detach().clone() for name, tensor in tensors.items()}
    state = hvd.elastic.TorchState(tensors=tensors)
    state.recover()
    state.commit()
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.zero_()  # work after the commit, lost by the restore
    state.restore()
    fresh = hvd.elastic.TorchState(tensors=None)
    fresh.recover()
    for got in (state.tensors, fresh.tensors):
        assert got.keys() == reference.keys()
        for name, want in reference.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            assert torch.equal(got[name].to_dense(), want.to_dense()), name
        assert got["leaf"].requires_grad and not got["int64"].requires_grad
        assert got["sparse"].is_sparse
