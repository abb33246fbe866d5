"""free_port: a port that a server started next can bind, handed out once per process."""

from __future__ import annotations

import socket

from agentaccel import processes


def test_servers_started_together_never_share_a_port(monkeypatch):
    """The same free port may be offered twice in a row. It once was to two of bench vllm's
    servers: both bound it while starting, one answered for both, and agentaccel's was measured on
    the other's server. free_port never hands out a port twice (the repeat injected here)."""
    offered = iter([21001, 21001, 21001, 21002])
    monkeypatch.setattr(processes, "_offered", lambda: next(offered))
    monkeypatch.setattr(processes, "_bindable", lambda port: True)  # whatever else on the host holds them
    monkeypatch.setattr(processes, "_HANDED_OUT", set())  # a fresh record of ports handed out
    assert [processes.free_port(), processes.free_port()] == [21001, 21002]


def test_a_port_is_never_one_the_kernel_gives_to_outgoing_connections():
    """CI lost a replay server's port: the OS picked 39639 as free, and before the server bound it
    some process's outgoing connection took it as its own local port (such ports come from the
    kernel's ephemeral range). free_port's ports lie outside that range, so no connection can."""
    ephemeral = processes._ephemeral_ports()
    ports = [processes.free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert not [p for p in ports if p in ephemeral]
    assert all(1024 < p < 65536 for p in ports)
    with socket.socket() as s:  # each can be bound by the server it is given to
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_some_socket_holds_is_skipped(monkeypatch):
    """A connected client socket holding a port (what took the replay server's) makes it unfree,
    even though nothing listens on it."""
    with socket.socket() as listener, socket.socket() as client:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client.connect(listener.getsockname())
        held = client.getsockname()[1]
        first, choose = iter([held]), processes._offered
        monkeypatch.setattr(processes, "_offered", lambda: next(first, None) or choose())  # the held one, then any
        monkeypatch.setattr(processes, "_HANDED_OUT", set())
        assert processes.free_port() != held
