"""deploy/haproxy.cfg on loopback in front of `headrace serve` replicas (subprocesses).

HAProxy comes from the Debian package that `make setup` installs (skipped with that
message where it is missing). Each test starts its own replicas and proxy and kills
them all in a finalizer; every wait is bounded (call deadlines, process timeouts).
Streams are dummy-tiny generations of up to 2000 tokens (a few seconds on CPU).
"""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.client import client
from tests.support.loadbalancer_cluster import Cluster, Replica, start_cluster, terminate

pytestmark = pytest.mark.skipif(
    shutil.which("haproxy") is None and not shutil.os.path.exists("/usr/sbin/haproxy"),
    reason="haproxy is not installed (make setup installs the Debian package as root)",
)


@pytest.fixture
def cluster(tmp_path, request) -> Iterator[Callable[..., Cluster]]:
    started: list[Cluster] = []

    def make(n: int, **kwargs) -> Cluster:
        started.append(start_cluster(tmp_path, n, **kwargs))
        return started[-1]

    yield make
    for c in started:
        c.close()


def _request(max_tokens: int):
    request = client.generate_request(token_ids=[5, 6, 7, 8], max_tokens=max_tokens)
    request.stopping.ignore_eos = True
    return request


_details: list[str] = []


def _stream(target: str, max_tokens: int, started: threading.Event | None = None):
    """(status code name, tokens received + 1 for the complete) of one Generate.

    Tokens, not messages: the server coalesces chunks a slow reader has not taken yet."""
    channel = grpc.insecure_channel(target)
    received = 0
    try:
        stub = client.pb_grpc.GenerationServiceStub(channel)
        for response in stub.Generate(_request(max_tokens), timeout=90):
            received += len(response.chunk.token_ids) if response.HasField("chunk") else 1
            if started is not None:
                started.set()
            if response.HasField("complete"):
                return "OK", received
        return "NO_COMPLETE", received
    except grpc.RpcError as exc:
        _details.append(exc.details())
        return exc.code().name, received
    finally:
        channel.close()


def _metrics(replica: Replica) -> dict[str, float]:
    url = f"http://127.0.0.1:{replica.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return {
            s.name + str(sorted(s.labels.items())): s.value for f in families for s in f.samples
        }


def _finished(replica: Replica) -> float:
    return sum(
        v for k, v in _metrics(replica).items() if k.startswith("headrace_requests_finished_total")
    )


def test_streams_land_on_every_replica_and_metrics_parse(cluster) -> None:
    c = cluster(3)
    with ThreadPoolExecutor(9) as pool:
        results = list(pool.map(lambda _: _stream(c.target, 300), range(9)))
    assert all(code == "OK" for code, _ in results), results
    finished = [_finished(r) for r in c.replicas]
    assert sum(finished) == 9 and all(n >= 1 for n in finished), finished
    for replica in c.replicas:
        metrics = _metrics(replica)
        for name in ("headrace_requests_running[]", "headrace_requests_waiting[]"):
            assert metrics[name] == 0


def test_stream_longer_than_the_proxy_timeouts_completes(cluster) -> None:
    # The shipped inactivity timeouts are an hour; shrink them to 1 s here so that a
    # ~3 s stream outlasts them in a test: a stream that keeps sending tokens is never
    # cut, however long it runs.
    short = {"timeout client 1h": "timeout client 1s", "timeout server 1h": "timeout server 1s"}
    c = cluster(1, overrides=short)
    begin = time.monotonic()
    code, received = _stream(c.target, 2000)
    assert (code, received) == ("OK", 2001)
    assert time.monotonic() - begin > 1.5


def test_killed_replica_new_requests_succeed_and_its_streams_fail_fast(cluster) -> None:
    c = cluster(3)
    with ThreadPoolExecutor(6) as pool:
        events = [threading.Event() for _ in range(6)]
        futures = [pool.submit(_stream, c.target, 2000, e) for e in events]
        assert all(e.wait(60) for e in events)
        victim = c.replicas[0]
        running = _metrics(victim)["headrace_requests_running[]"]
        victim.process.kill()
        victim.process.wait(timeout=30)
        killed = time.monotonic()
        results = [f.result(timeout=120) for f in futures]
    assert time.monotonic() - killed < 60  # the survivors' streams take ~5 s; nothing hung
    codes = [code for code, _ in results]
    assert running >= 1
    # The streams on the dead replica end at once, not at their 90 s deadline. HAProxy 2.6
    # closes them with an END_STREAM data frame and no trailers, which grpc reports as
    # UNKNOWN "Stream removed" (a replica reached directly reports UNAVAILABLE).
    broken = [c for c in codes if c != "OK"]
    assert len(broken) == running and set(broken) <= {"UNKNOWN", "UNAVAILABLE"}, (results, _details)
    assert codes.count("OK") == 6 - running, results
    # New requests right after the kill: a refused connection is retried on a live replica.
    after = [_stream(c.target, 20) for _ in range(6)]
    assert all(code == "OK" for code, _ in after), after


def test_sigterm_drains_a_replica_and_the_proxy_stops_sending_it_streams(cluster) -> None:
    c = cluster(2)
    draining, other = c.replicas
    with ThreadPoolExecutor(4) as pool:
        events = [threading.Event() for _ in range(4)]
        futures = [pool.submit(_stream, c.target, 2000, e) for e in events]
        assert all(e.wait(60) for e in events)
        on_draining = _metrics(draining)["headrace_requests_running[]"]
        terminate(draining)
        time.sleep(2.5)  # > one failed /health check (inter 1 s, fall 1)
        before = _finished(other)
        new = [_stream(c.target, 20) for _ in range(4)]
        results = [f.result(timeout=120) for f in futures]
    assert on_draining >= 1
    assert all(code == "OK" for code, _ in results), results  # drained, not cut
    assert all(code == "OK" for code, _ in new), new
    assert _finished(other) - before >= 4  # every new stream went to the other replica
    assert draining.process.wait(timeout=60) == 0
