"""backends/waiting.py: a wait polls until done, keeps its core for the first 100 µs, then
yields, then sleeps a twentieth of the time waited (at most 20 ms)."""
import time

from hvd_trainer.backends import waiting


def test_wait_until_polls_until_done():
    polls = []

    def done():
        polls.append(1)
        return len(polls) == 5
    waiting.wait_until(done)
    assert len(polls) == 5


def test_pause_keeps_the_core_then_yields_then_sleeps_a_share(monkeypatch):
    calls = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: calls.append("yield"))
    monkeypatch.setattr(waiting.time, "sleep", lambda seconds: calls.append(seconds))
    now = time.monotonic()
    waiting.pause(now + 1)  # not begun yet: keep the core
    waiting.pause(now - 0.01)
    waiting.pause(now - 0.2)
    waiting.pause(now - 10)
    assert calls[0] == "yield" and len(calls) == 3
    assert abs(calls[1] - 0.01) < 1e-3 and calls[2] == 0.02
