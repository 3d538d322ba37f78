"""The cost model's formulas (benchmarks/cost_model.py) against hand computations, with round
constants so that each expected figure can be worked out on paper."""
import importlib.util
import math
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "cost_model", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                               "cost_model.py"))
cost_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cost_model)

Link, Ring = cost_model.Link, cost_model.Ring
LINK = Link(alpha=10e-6, beta=1e-9)  # 10 µs, 1 GB/s
SHM = Link(alpha=1e-6, beta=0.1e-9)
HOST = cost_model.Host(shm=SHM, gather_beta=0.2e-9, bcast_beta=0.1e-9, reduce_beta=0.05e-9)
RING = Ring(step=5e-6, call=50e-6)
AGREEMENT = cost_model.Agreement(fixed=8e-6)


def test_the_record_is_sized_as_the_agreement_sizes_it_208_bytes_at_any_rank_count():
    # The payloads travel apart (the carrier) but for a small broadcast's, which has the
    # same room in every record, so the record is 208 bytes everywhere.
    assert [cost_model.record_bytes(n) for n in (2, 8, 64, 256, 257, 4096)] == [208] * 6


@pytest.mark.parametrize("ranks, total, name, rounds", [
    (1024, 1024 * 72, "recursive doubling", 10),
    (1000, 1000 * 72, "Bruck", 10),           # 72,000 B < 80 KiB
    (1500, 1500 * 72, "ring", 1499),          # 108,000 B: MPICH's ring
    (8192, 8192 * 72, "ring", 8191)])         # 576 KiB: past recursive doubling's 512 KiB
def test_mpichs_allgather_algorithm_follows_its_size_table(ranks, total, name, rounds):
    assert cost_model.allgather_algorithm(ranks, total) == (name, rounds)


def test_the_ring_pays_2_n_minus_1_steps_and_moves_2_n_minus_1_over_n_of_the_bytes():
    # 4 ranks, 1 MB: 6 steps of (10 + 5) µs, 1.5 MB at 1 GB/s, 0.75 MB summed at 20 GB/s.
    expected = 6 * 15e-6 + 1.5e6 * 1e-9 + 0.75e6 * 0.05e-9
    assert cost_model.ring_seconds(4, 1e6, link=LINK, ring=RING, reduce_beta=0.05e-9) == \
        pytest.approx(expected)
    assert cost_model.ring_seconds(1, 1e6, link=LINK, ring=RING, reduce_beta=0.05e-9) == 0


def test_the_hierarchical_allreduce_is_the_host_steps_and_a_ring_of_the_hosts():
    # 16 ranks, 8 per host, 100 MB: gather 7 x 100 MB to the first rank and sum them there
    # (3 tree levels of alpha), broadcast by scatter and ring allgather (8 ranks, 100 MB:
    # 3 + 7 alphas, 2 x 7/8 of the bytes), then a ring of 2 hosts.
    size = 100e6
    host = 3 * 1e-6 + 7 * size * (0.2e-9 + 0.05e-9) + (3 + 7) * 1e-6 + 2 * 7 / 8 * size * 0.1e-9
    ring = 2 * 15e-6 + size * 1e-9 + 0.5 * size * 0.05e-9
    assert cost_model.hierarchical_seconds(16, size, per_host=8, host=HOST, link=LINK,
                                           ring=RING) == pytest.approx(host + ring)


def test_powersgds_factors_are_small_and_summed_by_mpi_below_the_ring_threshold():
    pq = cost_model.factor_bytes(matrices=25, side=1000, rank=4)
    assert pq == 400_000
    # 2 ranks, 1 per host: reduce-scatter and allgather of 400 kB between 2 hosts.
    expected = 2 * 10e-6 + 2 * 0.5 * pq * 1e-9 + 0.5 * pq * 0.05e-9
    assert cost_model.allreduce_seconds(2, pq, per_host=1, host=HOST, link=LINK, ring=RING) == \
        pytest.approx(expected)
    constants = cost_model.Constants(host=HOST, ring=RING, agreement=AGREEMENT, codecs={},
                                     powersgd_compute=0.1, links={})
    assert cost_model.powersgd_seconds(2, per_host=1, constants=constants, link=LINK) == \
        pytest.approx(0.1 + 2 * (expected + 50e-6))


def test_a_packed_codec_encodes_once_gathers_every_payload_and_decodes_them_all():
    codec = cost_model.Codec(encode=0.5e-9, decode=0.25e-9, wire=1 / 16)
    size, payload = 100e6, 100e6 / 16
    # 1,500 ranks, one per host: counts by Bruck (12,000 B < 80 KiB, 11 rounds),
    # payloads by MPICH's ring (1,499 steps).
    counts = 11 * 10e-6 + 1499 * 8 * 1e-9
    gather = 1499 * (10e-6 + payload * 1e-9)
    expected = size * 0.5e-9 + counts + gather + 1500 * size * 0.25e-9 + 50e-6
    assert cost_model.packed_seconds(1500, size, codec=codec, per_host=1, host=SHM, link=LINK,
                                     call=50e-6) == pytest.approx(expected)
    assert cost_model.packed_memory_bytes(1500, size, codec=codec) == 1500 * payload


def test_the_agreement_is_an_allreduce_of_its_208_byte_record_at_any_rank_count():
    # 4096 ranks, 8 per host: 26 words < 512 hosts, so recursive doubling of 208 B among the
    # hosts (9 rounds), after a binomial reduce and broadcast of 208 B within each host.
    inside = 3 * (1e-6 + 208 * (0.1e-9 + 0.05e-9)) + 3 * (1e-6 + 208 * 0.1e-9)
    across = 9 * (10e-6 + 208 * (1e-9 + 0.05e-9))
    assert cost_model.agreement_seconds(4096, per_host=8, agreement=AGREEMENT, host=HOST,
                                        link=LINK) == pytest.approx(8e-6 + inside + across)
    # 64 ranks: the same within the host; among 8 hosts 26 words are not fewer than the
    # hosts, so reduce-scatter and allgather (2 x 3 rounds, 2 x 7/8 of 208 B, 7/8 summed).
    across = 6 * 10e-6 + 2 * 182 * 1e-9 + 182 * 0.05e-9
    assert cost_model.agreement_seconds(64, per_host=8, agreement=AGREEMENT, host=HOST,
                                        link=LINK) == pytest.approx(8e-6 + inside + across)


def test_the_link_fit_recovers_alpha_and_beta_from_exact_points():
    sizes = [8, 1024, 65536, 1 << 20, 16 << 20]
    fitted = cost_model.fit_link(sizes, [25e-6 + n * 0.8e-9 for n in sizes])
    assert fitted.alpha == pytest.approx(25e-6) and fitted.beta == pytest.approx(0.8e-9)


def test_the_runs_of_fastest_mechanisms_and_the_first_share_above_a_limit():
    def row(ring, powersgd):
        return cost_model.Mechanisms(ring=ring, hierarchical=math.inf, powersgd=powersgd,
                                     packed={"2-bit": math.inf})
    table = {8: row(1, 2), 16: row(1, 2), 32: row(3, 2), 64: row(4, 2)}
    assert cost_model.winners(table) == [("ring", 8, 16), ("PowerSGD", 32, 64)]
    assert cost_model.first_above({8: 0.01, 16: 0.2, 32: 0.3}, 0.10) == 16
    assert cost_model.first_above({8: 0.01}, 0.10) is None


def test_a_small_calls_fixed_costs_are_the_smallest_estimates_over_the_sizes():
    tiny = {"64": {"op": 100e-6, "agreement": 20e-6, "ring": 40e-6, "sendrecv": 5e-6},
            "1024": {"op": 90e-6, "agreement": 25e-6, "ring": 38e-6, "sendrecv": 6e-6}}
    fixed = cost_model.fixed_costs(tiny, 2)
    assert fixed.step == pytest.approx(13e-6)       # min(40/2 - 5, 38/2 - 6)
    assert fixed.call == pytest.approx(27e-6)       # min(100 - 20 - 40, 90 - 25 - 38)
    assert fixed.agreement == pytest.approx(20e-6)
    assert fixed.whole == pytest.approx(26.5e-6)    # min((100 - 20)/2 - 5, (90 - 25)/2 - 6)


def test_two_processes_measurements_keep_the_slower_of_each():
    first = {"powersgd": 0.1, "codecs": {"2-bit": {"encode": 2e-9, "decode": 1e-9}}}
    second = {"powersgd": 0.3, "codecs": {"2-bit": {"encode": 1e-9, "decode": 3e-9}}}
    assert cost_model.slower(first, second) == \
        {"powersgd": 0.3, "codecs": {"2-bit": {"encode": 2e-9, "decode": 3e-9}}}


_nccl_spec = importlib.util.spec_from_file_location(
    "nccl_model", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                               "nccl_model.py"))
nccl_model = importlib.util.module_from_spec(_nccl_spec)
_nccl_spec.loader.exec_module(nccl_model)
H100, A100 = nccl_model.FABRICS


def test_nccl_latencies_follow_its_tuner_by_hand():
    # Ring: 8.4 µs + 3.4 µs per NVLink step + 14 µs per step across hosts, 2(n-1) steps.
    assert nccl_model.ring_latency(8, 8) == pytest.approx((8.4 + 14 * 3.4) * 1e-6)
    assert nccl_model.ring_latency(16, 8) == pytest.approx((8.4 + 28 * 3.4 + 2 * 14) * 1e-6)
    # Tree: 8.4 µs + 2((L-1) * 4 µs + ceil(log2 H) * 14 µs).
    assert nccl_model.tree_latency(16, 8) == pytest.approx((8.4 + 2 * (7 * 4 + 1 * 14)) * 1e-6)
    assert nccl_model.tree_latency(512, 8) == pytest.approx((8.4 + 2 * (7 * 4 + 6 * 14)) * 1e-6)


def test_across_hosts_the_ring_runs_at_the_nvlink_or_the_nics_speed_whichever_is_less():
    assert nccl_model.ring_busbw(8, 8, H100) == 370e9  # one host: NVLink's
    assert nccl_model.ring_busbw(16, 8, H100) == 370e9  # 8 x 47 = 376 GB/s of NICs
    assert nccl_model.ring_busbw(16, 8, A100) == 192e9  # 8 x 24 GB/s of NICs


def test_a_bucket_takes_nccls_fastest_algorithm_or_the_host_time_if_longer():
    bucket = 16 << 20
    moved = bucket * 2 * 7 / 8  # busbw's bytes on 8 ranks
    nvls = 25e-6 + moved / 480e9  # one host: NVLS beats the ring (56 µs) and the tree (64.4 µs)
    assert nccl_model.nccl_seconds(bucket, 8, 8, H100) == pytest.approx(nvls)
    assert nccl_model.bucketed_busbw(bucket, 8, 8, H100, host=60e-6) == pytest.approx(moved / nvls)
    small = 1 << 20  # NVLS takes 28.8 µs: a 60 µs host time sets the pace
    assert nccl_model.bucketed_busbw(small, 8, 8, H100, host=60e-6) == \
        pytest.approx(small * 2 * 7 / 8 / 60e-6)
