"""A store on a real read-only mount (issue 23 item 12): a child in its own mount namespace
(``unshare -m``) bind-mounts the store read-only and reads it through the library
(``read_only=True``) and the CLI's read commands; a read-write open says why it cannot write.
Nothing in the store directory may change. Slow tier: subprocesses and mounts (needs root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from support import LAYOUT, Workload, open_store
from test_read_only import _crash_with_frames, tree

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

pytestmark = pytest.mark.slow

ROOT = REPO_DIR
W = Workload(LAYOUT, conversations=2, max_tokens=200)

CHILD = textwrap.dedent("""
    import json, subprocess, sys
    sys.path.insert(0, sys.argv[2])
    import snapstore as ss
    from support import IDENT, LAYOUT, Workload, empty_like_state, part_hashes
    root, out = sys.argv[1], {}
    W = Workload(LAYOUT, conversations=2, max_tokens=200)
    try:
        ss.Store.open(root, identity=IDENT, layout=LAYOUT)
    except ss.SnapstoreError as e:
        out["rw_error"] = f"{type(e).__name__}: {e}"
    with ss.Store.open(root, identity=IDENT, layout=LAYOUT, read_only=True) as st:
        exact = []
        for k in range(2):
            m = st.match(W.tokens(k))
            into = empty_like_state(W.state(k, 200))
            res = st.restore(m, into=into)
            exact.append(st.describe(m).nbytes == res.bytes_restored and
                         part_hashes(LAYOUT, into, res.rows) == part_hashes(LAYOUT, W.state(k, 200), res.rows))
        out["exact"] = exact
        out["snapshots"] = st.stats().snapshots
        out["verify"] = st.verify(deep=True).ok
        try:
            st.save(W.tokens(0)[:100], W.state(0, 100))
        except ss.StateError as e:
            out["save_error"] = str(e)
    for cmd in (["inspect"], ["stats"], ["verify", "--deep"], ["gc", "--dry-run"]):
        r = subprocess.run([sys.executable, "-m", "snapstore", "--dir", root, "--json", *cmd],
                           capture_output=True, text=True)
        out[" ".join(cmd)] = [r.returncode, r.stderr[-500:]]
    print(json.dumps(out))
""")


def _on_read_only_mount(src: str, tmp_path: Any) -> dict[str, Any]:
    """Run CHILD over ``src`` bind-mounted read-only in a private mount namespace; its JSON."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount the store read-only")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    script = (f'mount --bind "{src}" "{mnt}" && mount -o remount,ro,bind "{mnt}" && '
              f'exec "{sys.executable}" "{child}" "{mnt}" "{os.path.join(ROOT, "tests")}"')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSTORE_")}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                       text=True, timeout=300, env=env)
    if r.returncode != 0 and "unshare failed" in r.stderr:
        pytest.skip(f"cannot make a mount namespace here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr[-3000:]
    doc: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return doc


def _saved(path: str) -> str:
    with open_store(path) as s:
        for k in range(2):
            assert s.save(W.tokens(k)[:80], W.state(k, 80), parent=None).ok
            assert s.save(W.tokens(k)[:200], W.state(k, 200)).ok
    return path


@pytest.mark.parametrize("leftover", ["closed", "crashed writer"])
def test_store_on_a_read_only_mount_is_read_and_left_unchanged(tmp_path: Any, leftover: str) -> None:
    src = _saved(str(tmp_path / "s"))
    if leftover == "crashed writer":
        _crash_with_frames(src)  # frames in the -wal, a -shm: read through them, read-only
    before = tree(src)
    doc = _on_read_only_mount(src, tmp_path)
    assert doc["rw_error"].startswith(f"StoreIOError: [Errno 30] cannot open the store at {tmp_path / 'ro'} "
                                      "for writing: its file system is mounted read-only; to read it, open it "
                                      "with read_only=True"), doc
    assert doc["exact"] == [True, True] and doc["snapshots"] == 4 and doc["verify"], doc
    assert "is open read-only" in doc["save_error"], doc
    for cmd in ("inspect", "stats", "verify --deep", "gc --dry-run"):
        assert doc[cmd][0] == 0, (cmd, doc[cmd])
    assert tree(src) == before
