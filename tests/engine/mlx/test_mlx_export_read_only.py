"""``snapstore export-mlx-cache`` writes the prompt-cache file only (docs/cli.md's table): the store is
read, as ``snapstore export`` reads it, so it is left byte for byte as it was (was: opened for
writing, the export's match and restore recorded in the catalog; read-only, a store this user may
read but not write exports too — shown for export-slot in tests/engine/llamacpp, as a forked child
running mlx hangs). Real models (tiny, random weights), files, stores and the CLI entry point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="needs the mlx extra (mlx[cpu], mlx-lm)")

import mlx_models  # noqa: E402
from support.stores import tree_bytes  # noqa: E402
from test_mlx_files import A2, A, cache_file  # noqa: E402

from snapstore.cli.main import main  # noqa: E402


def _stored(base: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str, int]:
    """A store holding one imported prompt cache of a tiny model: (the store, the model's directory, its id)."""
    d = base / "model"
    model = mlx_models.write_model_dir("llama", d)
    f = cache_file(model, A, base / "a.safetensors", str(d))
    store = str(base / "store")
    assert main(["--dir", store, "--json", "import-mlx-cache", str(f), "--model", str(d),
                 "--tokens", ",".join(map(str, A))]) == 0
    return store, str(d), int(json.loads(capsys.readouterr().out)["snapshot_id"])


def test_export_mlx_cache_leaves_the_store_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, model, sid = _stored(tmp_path, capsys)
    before = tree_bytes(store)
    assert main(["--dir", store, "export-mlx-cache", str(tmp_path / "o1.safetensors"), "--model", model,
                 "--tokens", ",".join(map(str, A2))]) == 0
    assert main(["--dir", store, "export-mlx-cache", str(tmp_path / "o2.safetensors"), "--model", model,
                 "--id", str(sid)]) == 0
    assert f"snapshot {sid}, {len(A)} tokens" in capsys.readouterr().out
    assert tree_bytes(store) == before

