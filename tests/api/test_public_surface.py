"""The public surface: the exact exported names, every exported error inside SnapstoreError, and the
error tree drawn in snapstore/_errors.py's docstring and in docs/api.md equal to the real classes."""

from __future__ import annotations

import os
import re

import pytest

import snapstore
import snapstore._errors as errors_module

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

ROOT = REPO_DIR

CORE = {
    "Budget", "ConfigError", "CorruptChunkError", "CorruptionError", "DTYPE_NAMES", "DeleteResult",
    "DestinationError", "EngineMeta", "ExportFileError", "ExportResult", "Fixed", "FlushResult", "GcReport",
    "Identity", "IdentityError", "ImportResult", "InvalidInputError", "Layout", "LayoutError", "LoadResult",
    "Match", "MatchDetails", "NotFoundError", "PagedRows",
    "PartReader", "PartWriter", "RemoteError", "RestoreError", "RestoreResult", "RowSpan", "Rows", "SaveHandle",
    "SaveResult", "SnapshotInfo", "SnapshotUnavailableError", "SnapstoreError", "SourceError", "StateError",
    "Stats", "Store", "StoreFormatError", "StoreIOError", "Turn", "UnsupportedCacheError", "VerifyReport",
    "__version__", "dtype_size", "row_span",
    # restore or recompute (issue 32): Store.estimate_restore, match(prefill_tokens_per_s=), Match.why
    "Considered", "PrefillRate", "RecomputeDecision", "RestoreEstimate",
    # type aliases for annotating calls (docs/api.md "Type aliases")
    "Destination", "PartSource", "SnapshotRef", "TokensLike",
    # what the integrations need, public instead of the core's internals (issue 51): an output file written
    # by the store's rule, and the default store directory
    "OutputFile", "default_dir",
}
ENGINE = {
    "DEFAULT_STAGING_BYTES", "Staging", "TensorSink", "TensorSource", "TorchAdapter", "TorchPagedRows",
    "canonical", "dtype_name", "fixed_spec", "layout_of", "part_sink", "part_source", "rows_spec", "torch_dtype",
}
# snapstore.engine.torch: the old home's names and what the transformers integration uses of the adapter
TORCH = ENGINE | {"TokenIds", "shared_staging", "tensors_sha256"}


def test_exact_exports() -> None:
    assert set(snapstore.__all__) == CORE
    assert len(snapstore.__all__) == len(CORE)  # no name twice
    for name in CORE:
        assert hasattr(snapstore, name), name
    engine = pytest.importorskip("snapstore.engine")
    assert set(engine.__all__) == ENGINE
    for name in ENGINE:
        assert hasattr(engine, name), name
    torch_adapter = pytest.importorskip("snapstore.engine.torch")
    assert set(torch_adapter.__all__) == TORCH
    for name in TORCH:
        assert hasattr(torch_adapter, name), name


def test_every_exported_error_is_a_snapstore_error() -> None:
    exported = [getattr(snapstore, n) for n in snapstore.__all__]
    errors = [c for c in exported if isinstance(c, type) and issubclass(c, BaseException)]
    assert errors, "no exception classes exported"
    for cls in errors:
        assert issubclass(cls, snapstore.SnapstoreError), cls
    assert set(errors_module.__all__) == {c.__name__ for c in errors}


def _tree_of_classes() -> list[tuple[int, str, tuple[str, ...]]]:
    """(depth, name, builtin bases) in the order the docs draw them (declaration order)."""
    classes = [getattr(errors_module, n) for n in errors_module.__all__]
    order = {c: i for i, c in enumerate(sorted(classes, key=lambda c: c.__firstlineno__
                                               if hasattr(c, "__firstlineno__") else 0))}
    out: list[tuple[int, str, tuple[str, ...]]] = []

    def walk(cls: type, depth: int) -> None:
        mine = [b for b in cls.__bases__ if issubclass(b, snapstore.SnapstoreError)]
        others = tuple(b.__name__ for b in cls.__bases__ if not issubclass(b, snapstore.SnapstoreError))
        # a class is drawn under its first snapstore base; its other snapstore bases go in the brackets
        if cls is snapstore.SnapstoreError:
            others = ()  # the root is drawn bare (it is an Exception)
        out.append((depth, cls.__name__, tuple(b.__name__ for b in mine[1:]) + others))
        kids = [c for c in classes if c.__bases__ and
                [b for b in c.__bases__ if issubclass(b, snapstore.SnapstoreError)][:1] == [cls]]
        for kid in sorted(kids, key=lambda c: order.get(c, 0)):
            walk(kid, depth + 1)

    walk(snapstore.SnapstoreError, 0)
    return out


def _drawn(text: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """The tree as drawn: depth from the column of the name, name, the classes in brackets."""
    start = text.index("SnapstoreError\n")
    indent = start - (text.rfind("\n", 0, start) + 1)  # the docstring draws it indented
    lines = [line[indent:] for line in text[start - indent:].splitlines()]
    out = []
    for line in lines:
        m = re.match(r"^([│├└─ ]*)(\w+Error)(?:\(([^)]*)\))?", line)
        if m is None:
            if out and not line.strip():
                break
            if out and not re.match(r"^[│ ]+\S", line):
                break
            continue
        depth = len(m.group(1)) // 4
        bases = tuple(b.strip() for b in m.group(3).split(",")) if m.group(3) else ()
        out.append((depth, m.group(2), bases))
    return out


def _by_name(tree: list[tuple[int, str, tuple[str, ...]]]) -> dict[str, tuple[int, frozenset[str]]]:
    return {name: (depth, frozenset(bases)) for depth, name, bases in tree}


def test_error_tree_in_the_docstring_and_api_md_equals_the_classes() -> None:
    real = _by_name(_tree_of_classes())
    doc = errors_module.__doc__ or ""
    api = open(os.path.join(ROOT, "docs", "api.md")).read()
    api = api[api.index("## Errors"):]
    for where, text in (("snapstore/_errors.py docstring", doc), ("docs/api.md", api)):
        drawn = _by_name(_drawn(text))
        assert drawn == real, f"{where} draws {drawn}, the classes are {real}"
