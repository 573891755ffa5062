"""The remote's leases, which keep a push and a remote gc from overlapping (qbuild.store.remote): who waits for whom,
which leases count as live, and the one line a wait that runs out ends with."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest

from qbuild.core.errors import InfraError
from qbuild.store import remote as remote_mod
from qbuild.store.remote import holding, live_leases
from qbuild.store.s3 import S3Remote
from tests.s3server import s3_env, shared_server

BUCKET = "qb-leases"


@pytest.fixture(scope="module")
def server():
    srv = shared_server()
    srv.client().create_bucket(Bucket=BUCKET)
    return srv


@pytest.fixture
def remote(server, monkeypatch):
    for name, value in s3_env(server.endpoint).items():
        monkeypatch.setenv(name, value)
    return S3Remote(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}")


def _leases(remote: S3Remote) -> list[str]:
    return sorted(obj.name for obj in remote.list_leases()[0])


def test_a_gc_waits_for_a_push_and_a_push_gives_way_to_a_gc(remote):
    with holding(remote, "push"):
        with pytest.raises(InfraError) as info:
            with holding(remote, "gc", wait_s=0.5):
                pass
        assert str(info.value).startswith(f"{remote.url}: a push (host ") and "this gc waited" in str(info.value)
    with holding(remote, "gc"):
        with pytest.raises(InfraError, match="a gc .* this push waited"):
            with holding(remote, "push", wait_s=0.5):
                pass
        assert [n.split("-")[0] for n in _leases(remote)] == ["gc"]   # the waiting push withdrew its own
    assert _leases(remote) == []


def test_a_gc_goes_on_once_the_push_it_waits_for_ends(remote):
    entered = threading.Event()
    order = []

    def push() -> None:
        with holding(remote, "push"):
            entered.set()
            time.sleep(1.0)
            order.append("push done")

    thread = threading.Thread(target=push)
    thread.start()
    assert entered.wait(30)
    with holding(remote, "gc", wait_s=60):
        order.append("gc")
    thread.join()
    assert order == ["push done", "gc"]


def test_the_lease_of_a_process_that_is_gone_blocks_nothing_and_gc_removes_it(remote):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    pid = int(child.stdout)
    body = json.loads(remote_mod.RemoteLease(remote, "push").body)
    body.update(pid=pid, start="1")   # a process of this machine that has ended
    remote.put_lease("push-dead", json.dumps(body).encode())
    assert live_leases(remote, "push") == []
    with holding(remote, "gc", wait_s=5):
        pass
    assert _leases(remote) == []


def test_a_lease_from_another_machine_is_live_until_it_goes_stale(remote, monkeypatch):
    remote.put_lease("push-elsewhere", json.dumps({"kind": "push", "host": "builder-7", "pid": 1, "start": "9",
                                                   "namespace": "another-boot/pid:[1]"}).encode())
    with pytest.raises(InfraError, match=r"a push \(host builder-7, pid 1\)"):
        with holding(remote, "gc", wait_s=0.3):
            pass
    monkeypatch.setattr(remote_mod, "LEASE_TTL_S", 0.0)   # not rewritten within the TTL: its holder is gone
    with holding(remote, "gc", wait_s=5):
        pass
    assert _leases(remote) == []


def test_a_released_mark_counts_as_gone(remote):
    remote.put_lease("push-released", json.dumps({"kind": "push", "released": True}).encode())
    assert live_leases(remote, "push") == []


class _FlakyLeases:
    """A remote whose lease writes fail `failures` times after the first: what a lease sees of a remote that
    stops answering for a while. Stands in for S3Remote's lease calls only."""

    url = "s3://bucket/prefix"

    def __init__(self, failures: int):
        self.failures, self.writes = failures, 0

    def put_lease(self, name, body):
        self.writes += 1
        if 1 < self.writes <= 1 + self.failures:
            raise InfraError("s3://bucket/prefix/leases: connection refused")

    def delete_lease(self, name):
        pass


def test_a_failed_lease_refresh_is_retried_sooner_and_a_lapse_is_reported(monkeypatch):
    import time

    from qbuild.store import remote as remote_mod

    monkeypatch.setattr(remote_mod, "LEASE_REFRESH_S", 0.06)
    flaky = _FlakyLeases(failures=2)
    lease = remote_mod.RemoteLease(flaky, "push")
    lease.write()
    lease.keep()
    deadline = time.monotonic() + 120   # a hang guard: the loop ends as soon as the fourth write came
    while flaky.writes < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    lease.release()
    # Two failures, each retried after a sixth of the interval, then a write that got through.
    assert flaky.writes >= 4 and lease.refresh_error is None and not lease.lapsed
    monkeypatch.setattr(remote_mod, "LEASE_TTL_S", 0.0)
    assert not lease.lapsed                 # every refresh since the last write got through
    lease.refresh_error = InfraError("s3://bucket/prefix/leases: connection refused")
    assert lease.lapsed                     # a failing refresh, and no write for the TTL
