"""Names the module splits (issue 10) moved stay importable from their old private homes, so code
written against the old layout (other branches, users' scripts) keeps working after the merge."""

from __future__ import annotations

import importlib

import pytest

# old module -> (moved names, their new module)
MOVED = {
    "snapstore.llamacpp._bridge": (["ImportResult", "SlotStore", "export_snapshot"], "snapstore.llamacpp._slotstore"),
    "snapstore.llamacpp._slotfile": (["SlotProto", "empty_parts", "from_parts", "layout_for", "to_parts"],
                                     "snapstore.llamacpp._slotparts"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_names_are_the_new_objects(old: str) -> None:
    names, new = MOVED[old]
    old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_mod, name) is getattr(new_mod, name), f"{old}.{name}"


def test_slotfile_still_refuses_unknown_names() -> None:
    from snapstore.llamacpp import _slotfile as _slotfile

    with pytest.raises(AttributeError, match="no_such_name"):
        _slotfile.no_such_name  # noqa: B018


def test_torch_module_keeps_the_copy_alias() -> None:
    pytest.importorskip("torch")
    from snapstore.engine import _copy, _torch

    assert _torch.Copy is _copy.Copy
