"""Slow and numerous clients (issue 21, defect 10), over raw sockets against a real proxy on
127.0.0.1: a client that stalls in its headers or its body is answered 408 and let go, one that is
slow but steady is served, and connections past the cap are refused at once with a 503 while the
ones inside it keep working."""

import json
import socket
import time

import httpx
import pytest
from servers import ServerThread

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app

TIMEOUT = 1.0  # the proxy's read timeout in these tests
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(BODY))


@pytest.fixture
def server():
    with Upstream(tokens=3) as upstream, ServerThread(create_app(
            ProxyConfig(record=False, read_timeout=TIMEOUT, max_connections=8), OpenAIBackend(upstream.url))) as s:
        yield s


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def answer(sock: socket.socket) -> tuple[int, bytes]:
    """Status and everything the server sent until it closed the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def sent_slowly(sock: socket.socket, data: bytes, pieces: int, pause: float) -> None:
    step = -(-len(data) // pieces)
    for k in range(0, len(data), step):
        sock.sendall(data[k:k + step])
        time.sleep(pause)


def test_stalled_headers_get_a_408_and_the_connection_closes(server):
    for partial in (b"", HEAD[:20]):  # nothing at all after connecting, or half a request line
        sock = connect(server)
        sock.sendall(partial)
        t0 = time.monotonic()
        status, data = answer(sock)
        assert status == 408 and b'"header_timeout"' in data and TIMEOUT * 0.8 < time.monotonic() - t0 < 10


def test_a_stalled_body_gets_a_408_in_the_openai_shape(server):
    sock = connect(server)
    sock.sendall(HEAD + BODY[:10])
    t0 = time.monotonic()
    status, data = answer(sock)  # closed after the answer: the rest of the body never came
    error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert status == 408 and error["code"] == "body_timeout" and TIMEOUT * 0.8 < time.monotonic() - t0 < 10


def test_a_slow_but_steady_client_is_served(server):
    """Headers within the deadline, then a body whose pauses are each under it but whose whole
    takes three times as long."""
    sock = connect(server)
    sent_slowly(sock, HEAD, 3, TIMEOUT / 6)
    sent_slowly(sock, BODY, 6, TIMEOUT / 2)
    head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head[:200]


def test_connections_past_the_cap_are_refused_and_the_rest_still_work(server):
    held = [connect(server) for _ in range(8)]
    try:
        time.sleep(0.2)
        extra = connect(server)
        status, data = answer(extra)
        assert status == 503 and json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        held[0].sendall(HEAD + BODY)  # one inside the cap is served
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # once they are gone, anyone is served again
        r = httpx.post(server.url + "/v1/chat/completions", content=BODY, headers={"content-type": "application/json"})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200


def test_kept_alive_connections_get_the_deadline_for_each_request(server):
    with httpx.Client() as client:  # one connection, several requests, a pause longer than the deadline between
        for _ in range(2):
            r = client.post(server.url + "/v1/chat/completions", content=BODY,
                            headers={"content-type": "application/json"})
            assert r.status_code == 200
    sock = connect(server)
    sock.sendall(HEAD + BODY)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(HEAD[:15])  # a second request begins on the same connection and stalls
    rest = b""
    while chunk := sock.recv(65536):
        rest += chunk
    assert b"408 Request Timeout" in first + rest
