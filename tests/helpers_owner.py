"""Child process of the owner-liveness tests: ``python tests/helpers_owner.py MODE STORE [...]``.

``capture STORE K N DISK``: open the store (budget DISK bytes; the lease from
``$SNAPSTORE_PENDING_LEASE_S``), save a pending capture of conversation K after N tokens, print
``P <sid>``, then obey lines on stdin: ``commit`` → print ``C <sid or None>``; ``die`` → SIGKILL
itself (no close, no cleanup); ``fork`` → fork a helper that sleeps (no exec: it inherits the
open store), print ``F <pid>``; ``close`` → close the store and exit 0.

``resave STORE N CODEC``: a running engine beside a verify: evict every snapshot (gc to zero
entries), then save :func:`compressible_state` after N tokens again with CODEC; print ``S <sid>``.

``gcloop STORE SECONDS DISK``: a gc sidecar: gc (grace 2 s, disk budget DISK) in a loop for
SECONDS; print one JSON line {"runs", "dead_pending", "removed", "errors"}.

Run it under ``unshare`` to put it in another PID or UTS namespace; ``HELPER_KERNEL_ID`` (read
here, by the test helper, never by snapstore) sets the private ``snapstore.lifecycle.owner._kernel_override``
hook so that it looks like a process on another machine (its lock cannot be probed from here).
"""

from __future__ import annotations

import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import helpers_proc as hp  # noqa: E402
import numpy as np  # noqa: E402


def compressible_state(n: int) -> dict[str, np.ndarray]:
    """Parts after n tokens of conversation 0 that zstd shrinks (so its chunk files differ in size from raw)."""
    out = {}
    for name, spec in hp.LAYOUT.fixed.items():
        out[name] = (np.arange(spec.nbytes, dtype=np.uint8) % 3).view(spec.dtype).reshape(spec.shape)
    for name, spec in hp.LAYOUT.rows.items():
        out[name] = (np.arange(n * spec.row_bytes, dtype=np.uint8) % 5).view(spec.dtype).reshape((n, *spec.row_shape))
    return out


def resave(path: str, n: int, codec: str) -> None:
    from snapstore.chunks.repo import Repo
    from snapstore.lifecycle.gc import gc

    repo = Repo.open(path)
    try:
        gc(repo, max_entries=0, grace=3600)
    finally:
        repo.close()
    with hp.open_store(path, codec=codec, drop_stale=False) as s:
        r = s.save(hp.conv_tokens(0)[:n], compressible_state(n))
        print(f"S {r.snapshot_id}", flush=True)


def capture(path: str, k: int, n: int, disk: int) -> None:
    import time

    store = hp.open_store(path, disk=disk, drop_stale=False)
    r = store.save(hp.conv_tokens(k)[:n], hp.expected_state(k, n), commit=False)
    print(f"P {r.snapshot_id}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "commit":
            c = store.commit(r)
            print(f"C {c.snapshot_id}", flush=True)
        elif cmd == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif cmd == "fork":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # a forked worker that never touches the store, killed by the test
                os.write(w, b"1")  # running: the fork hook has dropped its copies of the lock fds
                time.sleep(120)
                os._exit(0)
            os.close(w)
            os.read(r, 1)  # report the helper only once it runs (the hook's tiny window is closed)
            os.close(r)
            print(f"F {pid}", flush=True)
        elif cmd == "close":
            store.close()
            return


def gcloop(path: str, seconds: float, disk: int) -> None:
    import json
    import time

    from snapstore import SnapstoreError
    from snapstore.chunks.repo import Repo
    from snapstore.lifecycle.gc import gc

    out: dict[str, object] = {"runs": 0, "dead_pending": 0, "removed": 0, "errors": []}
    errors: list[str] = []
    repo = Repo.open(path)
    stop = time.monotonic() + seconds
    try:
        while time.monotonic() < stop:
            try:
                rep = gc(repo, grace=2.0, disk_bytes=disk)
            except SnapstoreError as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            out["runs"] = int(str(out["runs"])) + 1
            out["dead_pending"] = int(str(out["dead_pending"])) + len(rep.dead_pending)
            out["removed"] = int(str(out["removed"])) + len(rep.removed_snapshots)
            time.sleep(0.02)
    finally:
        repo.close()
    out["errors"] = errors[:5]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if os.environ.get("HELPER_KERNEL_ID"):
        import snapstore.lifecycle.owner

        snapstore.lifecycle.owner._kernel_override = os.environ["HELPER_KERNEL_ID"]
    if sys.argv[1] == "capture":
        capture(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "gcloop":
        gcloop(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "resave":
        resave(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
