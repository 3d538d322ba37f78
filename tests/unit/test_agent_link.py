"""The driver-agent link of elastic engine jobs (hvd_trainer_launch.engines.agent_link) over
real sockets: an agent links up, takes a proxy command per life and sends each life's outcome
back; its drop is seen at once; nobody without the job's secret links up, commands an agent or
passes off an outcome, and a message replayed on a link is refused."""
import os
import socket
import threading
import time

import pytest

from hvd_trainer_launch import protocol
from hvd_trainer_launch.engines import agent_link
from hvd_trainer_launch.engines.agent_link import Hello, Message
from hvd_trainer_launch.engines.calls import HostOutcome

SECRET = os.urandom(32)


class _Driver:
    """Links on 127.0.0.1 that record what they see."""

    def __init__(self, secret=SECRET):
        self.changes = threading.Semaphore(0)
        self.messages = []
        self.links = agent_link.Links("127.0.0.1", secret, self.changes.release,
                                      lambda token, message: self.messages.append((token,
                                                                                   message)))

    def wait_change(self):
        assert self.changes.acquire(timeout=30), "no agent joined or left"

    def wait_messages(self, count):
        deadline = time.monotonic() + 30
        while len(self.messages) < count:
            assert time.monotonic() < deadline, self.messages
            time.sleep(0.01)


def _agent_in_thread(address, hello, run, secret=SECRET):
    def agent():
        agent_link.serve(agent_link.dial(address, secret, hello), run)
    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    return thread


def test_an_agent_takes_a_command_per_life_and_sends_each_outcome_back():
    driver = _Driver()
    ran = []

    def run(message):
        ran.append((message.fields["life"], message.fields["line"]))
        return HostOutcome("h2", 0, {3: b"three" * message.fields["life"], 4: b""}, "said")

    hello = Hello(2, "token-a", "h2", "e", {"gpu": ["1"]})
    try:
        thread = _agent_in_thread(driver.links.address, hello, run)
        driver.wait_change()
        assert driver.links.agents() == [hello]
        for life in (1, 2):
            assert driver.links.send("token-a", Message("run", {"life": life, "line": "go"}))
            driver.wait_messages(life)
            token, message = driver.messages[-1]
            assert token == "token-a" and message.fields["life"] == life
            # Checked against what run() returned, field by field.
            assert agent_link.outcome_of(message) == HostOutcome(
                "h2", 0, {3: b"three" * life, 4: b""}, "said")
        assert ran == [(1, "go"), (2, "go")]
    finally:
        driver.links.close()
    thread.join(30)
    assert not thread.is_alive(), "the agent did not end when the driver closed"


def test_a_dropped_agent_is_seen_at_once_and_its_token_cannot_come_back():
    driver = _Driver()
    try:
        side = agent_link.dial(driver.links.address, SECRET, Hello(0, "t", "h1", "e", {}))
        driver.wait_change()
        assert [hello.token for hello in driver.links.agents()] == ["t"]
        side.conn.close()  # as a killed task's connection
        driver.wait_change()
        assert driver.links.agents() == [] and [h.token for h in driver.links.lost()] == ["t"]
        assert not driver.links.send("t", Message("run", {"life": 1, "line": "x"}))
        again = agent_link.dial(driver.links.address, SECRET, Hello(0, "t", "h1", "e", {}))
        with pytest.raises((ConnectionError, OSError)):  # the driver hangs up on a repeat
            again.receive(time.monotonic() + 10)
    finally:
        driver.links.close()


def test_a_stranger_cannot_link_up_nor_pass_off_a_driver():
    driver = _Driver()
    try:
        with pytest.raises((OSError, ValueError)):
            agent_link.dial(driver.links.address, os.urandom(32), Hello(0, "s", "h", "e", {}))
        assert driver.links.agents() == []
    finally:
        driver.links.close()
    # A listener that does not know the secret cannot make an agent run anything: its
    # welcome does not check out.
    with socket.create_server(("127.0.0.1", 0)) as fake:
        port = fake.getsockname()[1]

        def answer():
            conn, _ = fake.accept()
            with conn:
                conn.sendall(os.urandom(16))
                conn.recv(4096)
                conn.sendall(os.urandom(32))
        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(ValueError, match="not signed with this job's secret"):
            agent_link.dial(f"127.0.0.1:{port}", SECRET, Hello(0, "s", "h", "e", {}))


class _Recording:
    """A connection's sending side that records what is sent."""

    def __init__(self, conn, sent):
        self.conn, self.sent = conn, sent

    def sendall(self, data):
        self.sent.append(data)
        self.conn.sendall(data)


def test_a_replayed_or_altered_message_is_refused():
    driver = _Driver()
    try:
        side = agent_link.dial(driver.links.address, SECRET, Hello(1, "r", "h1", "e", {}))
        driver.wait_change()
        conn, sent = side.conn, []
        side.conn = _Recording(conn, sent)
        side.send(agent_link.outcome_message(1, HostOutcome("h1", 0, {0: b"x"})))
        driver.wait_messages(1)
        conn.sendall(sent[0])  # the same bytes again: its place in the link is taken
        driver.wait_change()
        assert driver.links.agents() == [] and len(driver.messages) == 1
    finally:
        driver.links.close()
    driver = _Driver()
    try:
        side = agent_link.dial(driver.links.address, SECRET, Hello(1, "q", "h1", "e", {}))
        driver.wait_change()
        blob = bytearray(b"\0" * 64)
        header = b'{"kind": "outcome", "fields": {}, "blobs": 1}'
        side.conn.sendall(len(header).to_bytes(4, "big") + header + len(blob).to_bytes(8, "big")
                          + bytes(blob) + protocol.mac(SECRET, b"x"))
        driver.wait_change()
        assert driver.links.agents() == [] and driver.messages == []
    finally:
        driver.links.close()


@pytest.mark.parametrize("fields", [
    {"slot": -1, "token": "t", "host": "h", "executor": "e", "resources": {}},
    {"slot": True, "token": "t", "host": "h", "executor": "e", "resources": {}},
    {"slot": 0, "token": "t", "host": "", "executor": "e", "resources": {}},
    {"slot": 0, "token": "t", "host": "h", "executor": 1, "resources": {}},
    {"slot": 0, "token": "t", "host": "h", "executor": "e", "resources": {"gpu": [0]}},
])
def test_a_hello_of_the_wrong_form_is_refused(fields):
    driver = _Driver()
    try:
        with pytest.raises((OSError, ValueError)):
            side = agent_link.dial(driver.links.address, SECRET, Hello(**fields))
            side.receive(time.monotonic() + 10)
        assert driver.links.agents() == []
    finally:
        driver.links.close()


def test_outcome_of_refuses_what_is_not_an_outcome():
    good = agent_link.outcome_message(3, HostOutcome("h", 1, {0: b"a"}, ""))
    assert agent_link.outcome_of(good) == HostOutcome("h", 1, {0: b"a"}, "")
    for bad in (Message("run", good.fields, good.blobs), Message("outcome", good.fields, ()),
                Message("outcome", {**good.fields, "ranks": ["0"]}, good.blobs)):
        with pytest.raises(ValueError):
            agent_link.outcome_of(bad)


def test_a_new_start_of_a_slot_ends_the_old_link_and_drop_ends_a_slots_link():
    driver = _Driver()
    try:
        first = agent_link.dial(driver.links.address, SECRET, Hello(5, "first", "h1", "e", {}))
        driver.wait_change()
        second = agent_link.dial(driver.links.address, SECRET, Hello(5, "second", "h2", "e", {}))
        driver.wait_change()  # the second joins
        driver.wait_change()  # the first, superseded, leaves
        assert [hello.token for hello in driver.links.agents()] == ["second"]
        assert [hello.token for hello in driver.links.lost()] == ["first"]
        driver.links.drop(5)
        driver.wait_change()
        assert driver.links.agents() == []
        for side in (first, second):  # the driver's end is shut: each agent sees the end
            with pytest.raises(ConnectionError):
                side.receive(time.monotonic() + 10)
    finally:
        driver.links.close()
