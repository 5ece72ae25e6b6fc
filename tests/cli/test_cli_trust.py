"""Nothing a command does destroys a store, and the command tells a new user what happened (issue
46, items 10, 12 and the CLI parts of 14): an export never writes inside a store directory nor over
an existing file without ``--force`` (``Store.export`` likewise without ``overwrite=True``); an
import into a directory that holds no store creates it from the file; a store path that is a file,
a short import file, ``export --id 77``, ``--help``, ``gc``'s file list and inspect's "pinned" say
what is true. The fast tests run ``main()`` in this process on real stores; the two that need a
real process and a terminal (Ctrl-C while the command starts; progress meters) are in the slow tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import snapstore as ss
from snapstore.cli.main import main
from snapstore.cli.parser import build_parser

IDENT = ss.Identity(build="eng-1.0", pack="sha256:aa", kv="f16")
LAY = ss.Layout(fixed={"rec": ss.Fixed("float32", (4, 8))}, rows={"kv": ss.Rows("uint8", (64,))})
TOKENS = [7 + i for i in range(300)]
RNG = np.random.default_rng(46)
KV = RNG.integers(0, 256, (300, 64), dtype=np.uint8)
REC = RNG.standard_normal((4, 8)).astype(np.float32)
ROOT = Path(__file__).resolve().parents[2]


def open_store(path: str | Path, **kw: Any) -> ss.Store:
    return ss.Store.open(str(path), identity=IDENT, layout=LAY, chunk_bytes=4096, staging_bytes=64 * 1024, **kw)


def make_store(path: str | Path, name: str | None = "plan") -> int:
    """A store with a chain of two links (100, then 300 tokens); the leaf named; the leaf's id."""
    with open_store(path) as s:
        s.save(TOKENS[:100], {"rec": REC, "kv": KV[:100]})
        leaf = s.save(TOKENS, {"rec": REC, "kv": KV})
        assert leaf.snapshot_id is not None
        if name is not None:
            s.name(leaf, name)
        return leaf.snapshot_id


def exact(s: ss.Store, m: ss.SnapshotRef) -> bool:
    out = {"rec": np.zeros((4, 8), np.float32), "kv": np.zeros((300, 64), np.uint8)}
    r = s.restore(m, out)
    return r.n_tokens == 300 and out["rec"].tobytes() == REC.tobytes() and out["kv"].tobytes() == KV.tobytes()


def tree(path: str | Path) -> dict[str, str]:
    """Every file under ``path`` with the SHA-256 of its bytes (what "unchanged" means here)."""
    out = {}
    for r, _, fs in os.walk(path):
        for f in fs:
            p = os.path.join(r, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- item 10: export never destroys ------------------------------------------------------------
def test_export_never_writes_inside_a_store_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The store's own catalog, a file in its blobs/, another store's directory, a link into a store:
    refused with exit 2 and a message saying why; every store stays byte for byte as it was, and
    still restores."""
    src, other = tmp_path / "src", tmp_path / "other"
    make_store(src)
    make_store(other, name=None)
    (tmp_path / "into-src").symlink_to(src)
    before = {p: tree(p) for p in (src, other)}
    for dest in (src / "snapstore.db", src / "blobs" / "ab" / "x.snapx", src / "fresh.snapx",
                 other / "tmp" / "x.snapx", other / "snapstore.db-wal", tmp_path / "into-src" / "x.snapx"):
        code, out, err = run(capsys, "--dir", str(src), "export", "--name", "plan", str(dest))
        assert code == 2 and out == "" and "inside the snapstore store" in err, (dest, err)
    code, _, err = run(capsys, "--dir", str(src), "export", "--name", "plan", str(tmp_path / "snapstore.db"))
    assert code == 2 and "a store's own file name" in err
    assert {p: tree(p) for p in (src, other)} == before
    with open_store(src) as s:
        assert exact(s, s.named("plan") or 0)


def test_export_replaces_a_file_only_with_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    leaf = make_store(src)
    dest = tmp_path / "notes.txt"
    dest.write_text("a person's file")
    code, out, err = run(capsys, "--dir", str(src), "export", "--id", str(leaf), str(dest))
    assert code == 2 and "a file is there already" in err and "--force" in err
    assert dest.read_text() == "a person's file"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []  # no temp file left
    code, out, _ = run(capsys, "--dir", str(src), "--json", "export", "--id", str(leaf), str(dest), "--force")
    assert code == 0 and json.loads(out)["snapshot_id"] == leaf
    dst = tmp_path / "dst"
    with open_store(dst) as s:
        assert exact(s, s.import_file(str(dest)).snapshot_id)
    (tmp_path / "adir").mkdir()
    code, _, err = run(capsys, "--dir", str(src), "export", "--id", str(leaf), str(tmp_path / "adir"), "--force")
    assert code == 2 and "is a directory" in err


def test_the_api_export_keeps_the_same_rules(tmp_path: Path) -> None:
    """Store.export: never inside a store (its own included), an existing file only with
    overwrite=True; a refused export writes nothing."""
    src = tmp_path / "src"
    make_store(src)
    out = tmp_path / "plan.snapx"
    with open_store(src) as s:
        db = (src / "snapstore.db").read_bytes()
        with pytest.raises(ss.ConfigError, match="inside the snapstore store"):
            s.export("plan", src / "snapstore.db")
        assert (src / "snapstore.db").read_bytes() == db
        s.export("plan", out)
        first = out.read_bytes()
        with pytest.raises(ss.ConfigError, match="a file is there already"):
            s.export("plan", out)
        with pytest.raises(ss.InvalidInputError):
            s.export("plan", out, overwrite=1)  # type: ignore[arg-type]
        assert out.read_bytes() == first
        seen: list[tuple[int, int]] = []
        res = s.export("plan", out, overwrite=True, progress=lambda d, t: seen.append((d, t)))
        assert res.file_bytes == out.stat().st_size and seen and seen[-1][0] == seen[-1][1] > 0
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_export_of_no_such_id_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    make_store(src)
    code, out, err = run(capsys, "--dir", str(src), "export", "--id", "77", str(tmp_path / "x.snapx"))
    assert code == 1 and out == "" and "no snapshot 77" in err
    code, _, err = run(capsys, "--dir", str(src), "--json", "export", "--id", "77", str(tmp_path / "x.snapx"))
    assert code == 1 and json.loads(err)["exit"] == 1
    assert not (tmp_path / "x.snapx").exists()


# -- item 12: import creates a store -----------------------------------------------------------
def test_import_into_a_directory_without_a_store_creates_it(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The copy-a-file-to-a-new-host flow: a --dir that does not exist, or is empty, becomes a store
    for the file's identity and layout; the snapshot restores byte-exact and keeps its name."""
    src = tmp_path / "src"
    make_store(src)
    f = tmp_path / "plan.snapx"
    assert run(capsys, "--dir", str(src), "export", "--name", "plan", str(f))[0] == 0
    for new in (tmp_path / "hosts" / "b" / "cache", tmp_path / "empty"):
        if new.name == "empty":
            new.mkdir()
        code, out, err = run(capsys, "--dir", str(new), "--json", "import", str(f))
        assert code == 0, err
        doc = json.loads(out)
        assert doc["created_store"] is True and doc["links_added"] == 2 and doc["name"] == "plan"
        with open_store(new) as s:
            m = s.named("plan")
            assert m is not None and exact(s, m) and s.match(TOKENS) is not None
        code, out, _ = run(capsys, "--dir", str(new), "--json", "import", str(f))  # now a store: deduplicated
        assert code == 0 and json.loads(out)["created_store"] is False and json.loads(out)["chunks_written"] == 0
    code, out, _ = run(capsys, "--dir", str(tmp_path / "text"), "import", str(f))
    assert code == 0 and "into a new store at" in out


def test_import_refuses_a_directory_of_other_files_and_identity_without_a_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    make_store(src)
    f = tmp_path / "plan.snapx"
    assert run(capsys, "--dir", str(src), "export", "--name", "plan", str(f))[0] == 0
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "--dir", str(home), "import", str(f))
    assert code == 2 and "holds files but no snapstore store" in err
    assert sorted(os.listdir(home)) == ["notes.txt"]
    code, _, err = run(capsys, "--dir", str(tmp_path / "new"), "import", str(f), "--identity", IDENT.key)
    assert code == 2 and "holds no snapstore store" in err and not (tmp_path / "new").exists()
    bad = tmp_path / "bad.snapx"
    bad.write_bytes(f.read_bytes()[:2000])  # a valid header, cut short: the store is created, then refused
    code, _, err = run(capsys, "--dir", str(tmp_path / "cut"), "import", str(bad))
    assert code == 2 and "bad.snapx is refused" in err and "nothing imported" in err
    with open_store(tmp_path / "cut") as s:
        assert s.snapshots() == []


# -- item 14: what a new user is told ----------------------------------------------------------
def test_a_store_path_that_is_a_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "store.txt"
    f.write_text("not a store")
    for cmd in (["stats"], ["inspect"], ["verify"], ["gc", "--dry-run"], ["export", "--id", "1", "x"],
                ["import", str(f)]):
        code, out, err = run(capsys, "--dir", str(f), *cmd)
        assert code == 2 and out == "" and "is a file, not a store directory" in err, (cmd, err)
    assert f.read_text() == "not a store"


def test_a_short_import_file_is_named_in_the_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    make_store(src)
    short = tmp_path / "tiny.snapx"
    short.write_bytes(b"SNAPX-short\x00\x01")
    before = tree(src)
    code, _, err = run(capsys, "--dir", str(src), "import", str(short))
    assert code == 2 and f"{short} is refused" in err and "13 of 64 bytes" in err
    assert tree(src) == before


def test_help_lists_every_command_and_transfer_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    listed = re.search(r"^commands:\n((?:  .*\n)+)", text, re.M)
    assert listed is not None
    names = {line.split()[0] for line in listed.group(1).splitlines()}
    sub = next(a for a in build_parser()._actions if isinstance(a.choices, dict))
    assert names == set(sub.choices) and {"export", "import", "import-slot", "mlx-server"} <= names
    for cmd in ("export", "import"):
        assert main([cmd, "--help"]) == 0
        h = capsys.readouterr().out
        assert "examples:" in h and "snapstore --dir" in h and f" {cmd} " in h.split("examples:")[1]


def test_gc_summarises_files_and_lists_them_with_verbose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dry run over a store of many chunk files: the text counts them and lists 20, --verbose all;
    --json has every path."""
    d = tmp_path / "s"
    with open_store(d) as s:
        for k in range(6):
            kv = np.random.default_rng(k).integers(0, 256, (300, 64), dtype=np.uint8)
            assert s.save([1000 + k, *TOKENS[1:]], {"rec": REC, "kv": kv}).ok
    code, out, _ = run(capsys, "--dir", str(d), "--json", "gc", "--dry-run", "--max-entries", "0")
    files = json.loads(out)["chunk_files"]
    assert code == 0 and len(files) > 25
    code, out, _ = run(capsys, "--dir", str(d), "gc", "--dry-run", "--max-entries", "0")
    listed = [f for f in files if f in out]
    assert code == 0 and len(listed) == 20 and f"{len(files)}" in out and "--verbose lists them all" in out
    code, out, _ = run(capsys, "--dir", str(d), "gc", "--dry-run", "--max-entries", "0", "--verbose")
    assert code == 0 and all(f in out for f in files)


def test_inspect_calls_only_a_name_a_pin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A parent with a child "has children"; the named leaf is "pinned by name"; JSON says both
    (has_children, names), and keeps "pinned" (= has_children) for older scripts."""
    d = tmp_path / "s"
    leaf = make_store(d)
    code, out, _ = run(capsys, "--dir", str(d), "inspect")
    lines = {int(m.group(1)): line for line in out.splitlines() if (m := re.search(r"#(\d+)\s+\d+ tok", line))}
    root = next(i for i in lines if i != leaf)
    assert code == 0 and "has children" in lines[root] and "pinned" not in lines[root]
    assert "pinned by name 'plan'" in lines[leaf] and "has children" not in lines[leaf]
    code, out, _ = run(capsys, "--dir", str(d), "--json", "inspect")
    snaps = {x["id"]: x for x in json.loads(out)["snapshots"]}
    assert snaps[root]["has_children"] and snaps[root]["names"] == [] and snaps[root]["pinned"]
    assert not snaps[leaf]["has_children"] and snaps[leaf]["names"] == ["plan"]
    code, out, _ = run(capsys, "--dir", str(d), "inspect", str(leaf))
    assert code == 0 and "pinned by name 'plan'" in out and "has children" not in out
    code, out, _ = run(capsys, "--dir", str(d), "inspect", str(root))
    assert code == 0 and "has children: #" in out and "pinned" not in out


# -- the slow tier: real processes ------------------------------------------------------------
@contextlib.contextmanager
def _python_ctrl_c() -> Iterator[None]:
    """Children started inside get Python's own SIGINT handling, even where this run's SIGINT is
    ignored (a background job of a non-interactive shell: the child would inherit SIG_IGN)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _spawn(args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    """``python -m snapstore ARGS`` with Python's own SIGINT handling (see test_cli.py's _run_on_pty)."""
    with _python_ctrl_c():
        return subprocess.Popen([sys.executable, "-m", "snapstore", *args], cwd=ROOT, **kw)


def _importing(pid: int, deadline: float) -> bool:
    """Whether the child has begun importing the package (numpy's extension is mapped): Python's
    own start-up (before any code of ours can run) is over."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                if "numpy" in f.read():
                    return True
        except OSError:
            return False
        time.sleep(0.002)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_ctrl_c_in_the_first_second_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT at points across a command's first second (the package's import, parsing, the work):
    every run ends with exit 130 and one line on stderr, or (signal after the work) exit 0 — never
    a traceback; with --json the one line is the error object."""
    d = tmp_path / "s"
    make_store(d)
    seen: list[int] = []
    for i, delay in enumerate((0.0, 0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0)):
        cmd = ["--dir", str(d), *(["--json"] if i % 2 else []), ("stats", "inspect", "verify")[i % 3]]
        p = _spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert _importing(p.pid, time.monotonic() + 30)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        text = err.decode()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, (delay, text)
        assert p.returncode in (0, 130), (delay, p.returncode, text)
        if p.returncode == 130:
            lines = text.strip().splitlines()
            if i % 2:
                assert json.loads(text)["exit"] == 130, text
            else:
                assert len(lines) == 1 and lines[0].startswith("snapstore: error: interrupted"), text
        seen.append(p.returncode)
    assert 130 in seen
    with open_store(d) as s:
        assert exact(s, s.named("plan") or 0)
    # a program that imports snapstore as a library keeps Python's own Ctrl-C (KeyboardInterrupt)
    with _python_ctrl_c():
        lib = subprocess.run([sys.executable, "-c", "import signal, snapstore; "
                              "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert lib.returncode == 0 and lib.stdout.strip() == "True", lib.stderr


# A child that is the command (its start-up handler in place, as snapstore._cli_start.guard installs
# it) and whose Ctrl-C lands exactly while main() swaps the SIGINT handler: the two windows in which
# Python's own handler is in place but no `except KeyboardInterrupt` of main() covers the call.
_SWAP_CHILD = """
import os, signal, sys
import snapstore._cli_start as start
from snapstore.cli.main import main
real = signal.signal
which = signal.default_int_handler if sys.argv[1] == "take-over" else signal.SIG_IGN
done = []
def swap(sig, handler):
    if sig == signal.SIGINT and handler is which and not done:
        done.append(1)
        if which is signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGINT)  # before the swap: Python's handler still in place
        else:
            real(sig, handler)
            os.kill(os.getpid(), signal.SIGINT)  # right after it, inside take_over()
    return real(sig, handler)
signal.signal = swap
real(signal.SIGINT, start._interrupted)
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("window", ["take-over", "after-the-run"])
def test_ctrl_c_while_the_command_swaps_its_handler_is_no_traceback(tmp_path: Path, window: str) -> None:
    """A Ctrl-C inside take_over() (the start-up handler handed back) is reported as any early one
    (one line, exit 130); one while the finished run ignores SIGINT from then on leaves its exit 0.
    Before: a KeyboardInterrupt traceback from signal.signal (about one run in 40 of the test above)."""
    d = tmp_path / "s"
    make_store(d)
    p = subprocess.run([sys.executable, "-c", _SWAP_CHILD, window, "--dir", str(d), "stats"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    if window == "take-over":
        assert p.returncode == 130 and p.stderr.strip().startswith("snapstore: error: interrupted"), p.stderr
    else:
        assert p.returncode == 0, p.stderr


def _on_pty(args: list[str], env: dict[str, str], wait_for: bytes) -> tuple[int, bytes]:
    """Run with stderr on a terminal until it exits; SIGINT once ``wait_for`` shows up there (if given)."""
    master, slave = pty.openpty()
    p = _spawn(args, stdout=subprocess.DEVNULL, stderr=slave, env={**os.environ, **env})
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    chunk = b""
                seen += chunk
                if not chunk and p.poll() is not None:
                    break
            elif p.poll() is not None:
                break
            if wait_for and wait_for in seen and p.poll() is None:
                p.send_signal(signal.SIGINT)
                wait_for = b""
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    return p.returncode, seen


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "openpty") or sys.platform == "win32", reason="needs a POSIX pty")
def test_export_and_import_draw_progress_on_a_terminal(tmp_path: Path) -> None:
    """A chain of many chunks: export and import draw their meter on a terminal; an export
    interrupted mid-way leaves no file (nor temp file), an import interrupted mid-way leaves the
    store consistent; both exit 130."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    leaf = make_store(src)
    f = tmp_path / "plan.snapx"
    slow = {"_SNAPSTORE_PROGRESS_DELAY": "0.05"}
    rc, tty = _on_pty(["--dir", str(src), "export", "--name", "plan", str(f)], slow, b"")
    assert rc == 0 and b"export:" in tty and b"/s" in tty and f.exists()
    rc, tty = _on_pty(["--dir", str(dst), "import", str(f)], slow, b"")
    assert rc == 0 and b"import:" in tty
    with open_store(dst) as s:
        assert exact(s, s.named("plan") or 0)
    g = tmp_path / "again.snapx"
    rc, tty = _on_pty(["--dir", str(src), "export", "--id", str(leaf), str(g)], {"_SNAPSTORE_PROGRESS_DELAY": "0.5"},
                      b"export:")
    assert rc == 130 and b"interrupted" in tty and b"Traceback" not in tty
    assert sorted(os.listdir(tmp_path)) == ["dst", "plan.snapx", "src"]  # neither the file nor a temp file
    third = tmp_path / "third"
    rc, tty = _on_pty(["--dir", str(third), "import", str(f)], {"_SNAPSTORE_PROGRESS_DELAY": "0.5"}, b"import:")
    assert rc == 130 and b"interrupted" in tty and b"Traceback" not in tty
    r = subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(third), "--json", "verify"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
