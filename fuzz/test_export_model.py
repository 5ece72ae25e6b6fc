"""Export files drawn from a model of the format (issue 46, "Done when"): every file either imports
a chain that restores byte-exact, or is refused with ExportFileError and changes nothing.

Hypothesis draws a chain (1-3 links; a row stream, optionally a fixed part and a ``draft``
component stream; one row a token, or one per 4 tokens (block-granular); superseded links
without their fixed parts; 4- or 8-byte tokens; a namespace, a name, the override mark) and
writes it with tests/support/export_model.py, which packs every
section from docs/format.md itself. Then, for most examples, it breaks one field — a negative
token, a namespace or name no call could reach, rows or sizes that do not add up, a chunk index
out of range, a stream the leaf continues but an ancestor lacks, a leaf without a fixed part, the
mark's flag and field disagreeing, chunk bytes that fail their checksum... — with every checksum
recomputed, so only what the fields say is wrong. A few "breakages" keep the file valid (another
token value): those must import and restore like the rest.

Each file is imported into a fresh real store (the layout and, for a marked file, the override it
asks for). Imported: the leaf restores byte-exact by id, every matchable link restores byte-exact
through match(), and a marked chain is never matched. Refused: ExportFileError only, and the
store's chunk files, temp folder and snapshots are as before. Examples follow the Hypothesis
profile (dev: 6, ci: 80, long: 1000).
"""

from __future__ import annotations

import base64
import os
import struct
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snapstore as ss

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from support.export_model import ModelFile, ModelLink, ModelPart, encode  # noqa: E402
from support.profile import PROFILE, examples  # noqa: E402

IDENT = ss.Identity(build="eng-1.0", pack="sha256:model-q8", kv="f16")
OTHER = ss.Identity(build="eng-1.0", pack="sha256:model-q4", kv="f16")
FIXED, DRAFT = 12, 2  # bytes of the fixed part; of a draft row

Doc = dict[str, Any]
Mutation = Callable[[Doc, list[bytes]], None]


@st.composite
def models(draw: st.DrawFn) -> ModelFile:
    row = draw(st.sampled_from([4, 8]))
    g = draw(st.sampled_from([None, None, 4]))  # block-granular streams: one row per g tokens (no fixed parts)
    has_fixed, has_draft = g is None and draw(st.booleans()), draw(st.booleans())
    parts = [ModelPart("kv", "rows", (row,))]
    parts += [ModelPart("rec", "fixed", (FIXED,))] if has_fixed else []
    parts += [ModelPart("dr", "rows", (DRAFT,), "draft")] if has_draft else []
    width = draw(st.sampled_from([4, 8]))
    top = 2**31 - 1 if width == 4 else 2**63 - 1
    n_links = draw(st.integers(1, 3))
    links, rows, n = [], 0, 0
    for j in range(n_links):
        k = draw(st.integers(g or 1 if j == 0 else 1, 10))  # the root holds a row: every file has a chunk
        toks = draw(st.lists(st.integers(0, top), min_size=k, max_size=k))
        n += k
        r = n // (g or 1) - rows  # this link's rows (0 for a block-granular link shorter than a block)
        data: dict[str, tuple[int, int, bytes]] = {"kv": (rows, rows + r, draw(st.binary(min_size=r * row,
                                                                                       max_size=r * row)))}
        if has_draft:
            data["dr"] = (rows, rows + r, draw(st.binary(min_size=r * DRAFT, max_size=r * DRAFT)))
        superseded = j < n_links - 1 and has_fixed and draw(st.booleans())
        if has_fixed and not superseded:  # a superseded link is kept for its rows, without its fixed parts
            data["rec"] = (0, 0, draw(st.binary(min_size=FIXED, max_size=FIXED)))
        rows += r
        links.append(ModelLink(toks, data, matchable=not superseded))
    return ModelFile(IDENT, parts, links, namespace=draw(st.sampled_from(["", "tenant-a"])),
                     name=draw(st.sampled_from([None, "agent"])),
                     imported_from=draw(st.sampled_from([None, OTHER.key])),
                     chunk_bytes=draw(st.sampled_from([8, 24, 4096])), token_width=width, tokens_per_row=g)


# -- one-field breakages: (label, applies to the model?, how) ----------------------------------------------
def _tokens(link: Doc, values: list[int]) -> None:
    fmt = "<i" if link["token_width"] == 4 else "<q"
    link["tokens"] = base64.b64encode(b"".join(struct.pack(fmt, v) for v in values)).decode()


def _link_tokens(link: Doc) -> list[int]:
    raw = base64.b64decode(link["tokens"])
    return list(np.frombuffer(raw, "<i4" if link["token_width"] == 4 else "<i8"))


@st.composite
def breakages(draw: st.DrawFn, m: ModelFile) -> tuple[str, ModelFile, Mutation | None, bool]:
    """(label, model, mutation of the written document, whether the file stays valid)."""
    kinds = ["none", "negative_token", "namespace_long", "namespace_type", "name_control", "rows_shift",
             "nbytes", "chunk_index", "n_tokens", "mark_bogus", "mark_flag", "chunk_bytes", "identity_key",
             "token_width", "unreferenced_chunk", "other_token"]
    if len(m.links) > 1:
        kinds.append("ancestor_lacks_stream")
    if any(p.kind == "fixed" for p in m.parts):
        kinds.append("leaf_lacks_fixed")
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return kind, m, None, True
    if kind == "ancestor_lacks_stream":  # the leaf continues kv from row 0 though link 0 holds none
        first = m.links[0].parts["kv"][1]
        links = [ModelLink(m.links[0].tokens, {k: v for k, v in m.links[0].parts.items() if k != "kv"},
                           m.links[0].matchable)]
        for ln in m.links[1:]:
            r0, r1, data = ln.parts["kv"]
            links.append(ModelLink(ln.tokens, {**ln.parts, "kv": (r0 - first, r1 - first, data)}, ln.matchable))
        return kind, _with(m, links=links), None, False
    if kind == "leaf_lacks_fixed":
        leaf = m.links[-1]
        links = [*m.links[:-1], ModelLink(leaf.tokens, {k: v for k, v in leaf.parts.items() if k != "rec"})]
        return kind, _with(m, links=links), None, False
    if kind == "mark_flag":  # the preamble's flag says the opposite of the header's field
        return kind, _with(m, flags=0 if m.imported_from else 1), None, False
    j = draw(st.integers(0, 1 << 16))
    flip = draw(st.integers(0, 255).filter(bool))

    def mutate(doc: Doc, frames: list[bytes]) -> None:
        link = doc["chain"][j % len(doc["chain"])]
        kv = next(p for p in link["parts"] if p["name"] == "kv")
        if kind == "negative_token":
            values = _link_tokens(link)
            values[j % len(values)] = -1 - j
            _tokens(link, values)
        elif kind == "other_token":  # still a valid file: another prompt, the same state
            values = _link_tokens(link)
            values[j % len(values)] = (int(values[j % len(values)]) + 1 + j) % (2**31)
            _tokens(link, values)
        elif kind == "namespace_long":
            doc["namespace"] = "n" * (257 + j % 800)
        elif kind == "namespace_type":
            doc["namespace"] = j
        elif kind == "name_control":
            doc["name"] = f"agent{chr(j % 32)}x"
        elif kind == "rows_shift":
            kv["row_start"] += 1
            kv["row_end"] += 1
        elif kind == "nbytes":
            kv["nbytes"] += 1 + j % 7
        elif kind == "chunk_index":
            kv["chunks"].append(len(doc["chunks"]) + j % 3)
        elif kind == "n_tokens":
            doc["chain"][-1]["n_tokens"] += 1
        elif kind == "mark_bogus":
            doc["imported_from"] = "bogus-" + str(j)
        elif kind == "chunk_bytes":  # a payload byte flipped: its XXH3-128 no longer matches the table
            i = j % len(frames)
            body = bytearray(frames[i])
            at = 64 + j % (len(body) - 64)
            body[at] ^= flip
            frames[i] = bytes(body)
        elif kind == "identity_key":
            doc["identity_key"] = "id-" + "0" * 32
        elif kind == "token_width":
            link["token_width"] = 2
        elif kind == "unreferenced_chunk":
            doc["chunks"].append(dict(doc["chunks"][0]))
            frames.append(frames[0])

    return kind, m, mutate, kind == "other_token"


def _with(m: ModelFile, **kw: Any) -> ModelFile:
    fields = {k: getattr(m, k) for k in ("identity", "parts", "links", "namespace", "name", "imported_from",
                                         "chunk_bytes", "token_width", "flags", "tokens_per_row")}
    return ModelFile(**{**fields, **kw})


# -- the property ----------------------------------------------------------------------------------
def _state(root: str, s: ss.Store) -> tuple[Any, ...]:
    files = []
    for sub, _dirs, names in os.walk(os.path.join(root, "blobs")):
        files += [(n, os.path.getsize(os.path.join(sub, n))) for n in names]
    return sorted(files), sorted(os.listdir(os.path.join(root, "tmp"))), [i.snapshot_id for i in s.snapshots()]


def _restored(s: ss.Store, m: ModelFile, ref: Any, upto: int, ns: str | None) -> dict[str, bytes]:
    rows = len(m.tokens(upto)) // (m.tokens_per_row or 1)
    into: dict[str, np.ndarray] = {}
    for p in m.parts:
        into[p.name] = np.zeros(p.shape if p.kind == "fixed" else (rows, *p.shape), np.uint8)
    res = s.restore(ref, into, namespace=ns) if isinstance(ref, int) else s.restore(ref, into)
    assert res.n_tokens == len(m.tokens(upto))
    return {k: v.tobytes() for k, v in into.items()}


@settings(max_examples=examples(80 if PROFILE != "long" else 1000, 6), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_every_model_file_imports_exactly_or_is_refused_changing_nothing(data: Any) -> None:
    model = data.draw(models(), "model")
    kind, m, mutate, valid = data.draw(breakages(model), "breakage")
    with tempfile.TemporaryDirectory(prefix="snapx-model-") as tmp:
        path, root = os.path.join(tmp, "f.snapx"), os.path.join(tmp, "store")
        with open(path, "wb") as f:
            f.write(encode(m, mutate))
        with ss.Store.open(root, identity=IDENT, layout=model.layout(), chunk_bytes=4096,
                           staging_bytes=64 * 1024) as s:
            before = _state(root, s)
            try:
                r = s.import_file(path, accept_identity=m.imported_from)
            except ss.ExportFileError:
                assert not valid, f"a valid file ({kind}) was refused"
                assert _state(root, s) == before, f"a refused file ({kind}) changed the store"
                return
            assert valid, f"a broken file ({kind}) was imported"
            ns = m.namespace or None
            leaf = len(m.links) - 1
            assert _restored(s, m, r.snapshot_id, leaf, ns) == m.expected()
            toks = [t for ln in (_decoded(m, mutate) if mutate else m.links) for t in ln.tokens]
            if m.imported_from is not None:
                assert s.match(toks, namespace=ns) is None  # an override import is never an exact hit
                return
            n = 0
            for j, ln in enumerate(m.links):
                n += len(ln.tokens)
                if not ln.matchable:
                    continue
                hit = s.match(toks[:n], namespace=ns)
                assert hit is not None and hit.n_tokens == n, (kind, j)
                assert _restored(s, m, hit, j, ns) == m.expected(j)
            assert s.verify(deep=True).ok


def _decoded(m: ModelFile, mutate: Mutation) -> list[ModelLink]:
    """The links with the tokens the written file holds (a valid mutation may have changed one)."""
    from support.export_model import _build

    built = _build(m)
    mutate(built.doc, built.frames)
    return [ModelLink([int(t) for t in _link_tokens(d)], ln.parts, ln.matchable)
            for d, ln in zip(built.doc["chain"], m.links)]
