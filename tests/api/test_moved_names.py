"""Public names keep working from their old homes after a move (issue 51: the integrations moved
under engine/); private module paths move freely.

- ``snapstore.engine.<name>``: the torch adapter's names, now in ``snapstore.engine.torch``.
- ``snapstore.llamacpp``: the llama.cpp slot-file codec, now in ``snapstore.engine.llamacpp``.
- Inside the llama.cpp integration, names earlier module splits (issue 10) moved.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

# old module -> (moved names, their new module)
MOVED = {
    "snapstore.llamacpp": (["KNOWN_VERSIONS", "LlamaBridge", "ModelShape", "SlotFile", "SlotFormatError", "SlotStore",
                            "decode", "encode"], "snapstore.engine.llamacpp"),
    # the path earlier docs showed for the bridge (docs/engine.md "llama.cpp")
    "snapstore.llamacpp._bridge": (["LlamaBridge", "SlotStore"], "snapstore.engine.llamacpp"),
    "snapstore.engine.llamacpp._bridge": (["ImportResult", "SlotStore", "export_snapshot"],
                                          "snapstore.engine.llamacpp._slotstore"),
    "snapstore.engine.llamacpp._slotfile": (["SlotProto", "empty_parts", "from_parts", "layout_for", "to_parts"],
                                            "snapstore.engine.llamacpp._slotparts"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_names_are_the_new_objects(old: str) -> None:
    names, new = MOVED[old]
    old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_mod, name) is getattr(new_mod, name), f"{old}.{name}"


def test_slotfile_still_refuses_unknown_names() -> None:
    from snapstore.engine.llamacpp import _slotfile as _slotfile

    with pytest.raises(AttributeError, match="no_such_name"):
        _slotfile.no_such_name  # noqa: B018


def test_the_torch_adapter_keeps_its_old_home() -> None:
    pytest.importorskip("torch")
    import snapstore.engine
    import snapstore.engine.torch

    assert set(snapstore.engine.__all__) <= set(snapstore.engine.torch.__all__)
    for name in snapstore.engine.__all__:
        assert getattr(snapstore.engine, name) is getattr(snapstore.engine.torch, name), name


def test_engine_package_imports_no_runtime() -> None:
    """``import snapstore.engine`` (and the CLI that registers the integrations' commands) loads neither
    torch nor mlx: each runtime is imported when one of its names is first used."""
    code = ("import sys, snapstore.engine, snapstore.engine.mlx, snapstore.cli.parser as p; p.build_parser(); "
            "print(sorted(m for m in ('torch', 'mlx', 'mlx_lm', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
