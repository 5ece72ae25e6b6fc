"""``snapstore bench`` (issue 48 item 4): for the store it is pointed at, the raw limits and a scratch
store's figures side by side, and the cold-read path the store chose and why — kept in the store's
catalog; the store's own snapshots untouched, nothing left in tmp/. Figures are the machine's: the
test checks their presence and consistency, never their size."""

from __future__ import annotations

import json
import os
from typing import Any

import apsw
import pytest
from support import LAYOUT, Workload, open_store

from snapstore.cli.main import main
from snapstore.restore import read_path as rp


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_reports_limits_figures_and_the_kept_choice(store_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    w = Workload(LAYOUT, conversations=1, max_tokens=100)
    with open_store(store_dir) as s:
        assert s.save(w.tokens(0)[:100], w.state(0, 100)).ok
        before = s.stats().snapshots
    code, out, err = _run(capsys, "--dir", store_dir, "--json", "bench", "--size-mib", "16", "--repeat", "1")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["command"] == "bench" and rep["format"] == 1 and rep["bytes"] > 0
    assert rep["storage_key"] == rp.storage_key(store_dir) and rep["storage"] and rep["machine"]
    raw, store, path = rep["raw"], rep["store"], rep["read_path"]
    assert raw["write_buffered"] > 0 and raw["read_cold_buffered"] > 0 and raw["read_warm"] > 0
    assert store["save"]["Bps"] > 0 and store["restore_warm_first"]["Bps"] > 0
    chosen = path["chosen"]
    assert store[f"restore_cold_{chosen}"]["Bps"] > 0 and path["why"]
    best = max(v for k, v in raw.items() if k.startswith("read_cold_"))
    x = store[f"restore_cold_{chosen}"]["x"]
    assert x == pytest.approx(store[f"restore_cold_{chosen}"]["Bps"] / best)  # the baseline: the best raw read
    # kept in the store's catalog, for this storage, as the store itself would use it
    c = apsw.Connection(os.path.join(store_dir, "snapstore.db"), flags=apsw.SQLITE_OPEN_READONLY)
    rows = list(c.execute("SELECT storage, method, reason FROM read_paths"))
    c.close()
    assert rows == [(rep["storage_key"], "buffered" if chosen == "buffered" else "direct", path["why"])]
    with open_store(store_dir) as s:
        assert s._reads.row is not None and s._reads.row.reason == path["why"]
        assert s.stats().snapshots == before
    assert os.listdir(os.path.join(store_dir, "tmp")) == []
    code, out, _ = _run(capsys, "--dir", store_dir, "bench", "--size-mib", "16", "--repeat", "1")
    assert code == 0 and "read path:" in out and "raw limits" in out and "(chosen)" in out


@pytest.mark.parametrize("argv", [("--size-mib", "8"), ("--repeat", "0")])
def test_bench_refuses_bad_sizes(store_dir: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, str]) -> None:
    code, _, err = _run(capsys, "--dir", store_dir, "bench", *argv)
    assert code == 2 and "must be" in err


def test_bench_refuses_a_directory_that_is_not_a_store(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = _run(capsys, "--dir", str(tmp_path), "bench", "--size-mib", "16")
    assert code == 2 and "not a snapstore store" in err
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_bench_measures_a_save_whatever_the_stores_write_policy_and_reports_a_refused_one(
        store_dir: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch store saves whatever write admission the environment sets for the user's stores (a
    "second_hit" store skips a first save: bench died on an assert); a save the free-space reserve
    refuses is a clear error, exit 2, and the scratch files go."""
    with open_store(store_dir):
        pass
    monkeypatch.setenv("SNAPSTORE_ADMIT", "second_hit")
    code, out, err = _run(capsys, "--dir", store_dir, "--json", "bench", "--size-mib", "16", "--repeat", "1")
    assert code == 0, err
    assert json.loads(out)["store"]["save"]["Bps"] > 0
    monkeypatch.delenv("SNAPSTORE_ADMIT")
    monkeypatch.setenv("SNAPSTORE_RESERVE_MIB", str(1 << 40))
    code, _, err = _run(capsys, "--dir", store_dir, "bench", "--size-mib", "16", "--repeat", "1")
    assert code == 2 and "was skipped (disk_full)" in err and "SNAPSTORE_RESERVE_MIB" in err
    assert "Traceback" not in err
    assert os.listdir(os.path.join(store_dir, "tmp")) == []
