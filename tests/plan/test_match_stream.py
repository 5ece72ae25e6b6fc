"""match()'s chain check streams a candidate's ancestor links (``Txn.chain_links``, each compared
inside SQLite or, for a link of another width, by its blob) and checks each as it arrives
(``spells_chain``), holding none: the answers must be those of the
whole-chain check (``spells_prefix``) on every chain, a mismatching link below a matching own
segment passes the candidate over, and a malformed blob anywhere in the chain is still reported
as corrupt, past a mismatch too.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from support import open_store

import snapstore as ss
from snapstore import _tokens
from snapstore._tokens import BLOCK, as_token_array
from snapstore.catalog.find_keys import find_keys

TINY = ss.Layout(rows={"t": ss.Rows("uint8", (1,))})


def _save(s: ss.Store, toks: np.ndarray, parent: object = "auto") -> ss.SaveResult:
    rows = (np.arange(len(toks), dtype=np.uint64) % 251).astype(np.uint8).reshape(-1, 1)
    r = s.save(toks, {"t": rows}, parent=parent)
    assert r.ok
    return r


def _set_key(s: ss.Store, sid: int, key: int) -> None:
    s._repo.db.write(lambda c: c.execute("UPDATE snapshots SET find_key = ? WHERE id = ?", (key, sid)))


def _streamed(segs: list[_tokens.Segment]) -> list[_tokens.Link]:
    """A chain's ancestors (all but the leaf, root first) as chain_links yields links of another
    width than the one it compares: each with its blob."""
    return [(lvl, w, base, n, len(blob), None, blob) for lvl, (blob, w, base, n) in enumerate(reversed(segs[:-1]), 1)]


def test_the_streamed_check_answers_as_the_whole_chain_check() -> None:
    rng = np.random.default_rng(11)
    checked = 0
    for case in range(300):
        n = int(rng.integers(1, 3000))
        toks = rng.integers(0, 2**40 if case % 3 == 0 else 150_000, n).astype("<u8")
        cuts = sorted({0, n, *rng.integers(0, n, int(rng.integers(1, 7))).tolist()})
        segs = []
        for a, b in zip(cuts, cuts[1:]):
            blob, width = _tokens.encode_tokens(toks[a:b])
            segs.append((blob, width, a, b))
        query = np.concatenate([toks, rng.integers(0, 1000, int(rng.integers(0, 50))).astype("<u8")])
        variants = [query]
        for _ in range(3):  # a token changed in some link, or wrapped by 2**32 (no int32 blob holds it)
            v = query.copy()
            v[int(rng.integers(0, n))] += 1 if rng.random() < 0.5 else 2**32
            variants.append(v)
        for q in variants:
            if not _tokens.spells_segment(segs[-1], q):
                continue  # match() compares the own segment first; only a matching one streams on
            checked += 1
            assert _tokens.spells_chain(segs[-1], _streamed(segs), q) == _tokens.spells_prefix(segs, q), case
    assert checked > 300


def test_links_out_of_order_or_past_the_root_never_match() -> None:
    toks = np.arange(3000, dtype="<u8")
    segs = [(_tokens.encode_tokens(toks[a:b])[0], 4, a, b) for a, b in ((0, 1000), (1000, 2000), (2000, 3000))]
    assert _tokens.spells_chain(segs[-1], _streamed(segs), toks)
    anc = _streamed(segs)
    assert not _tokens.spells_chain(segs[-1], anc[::-1], toks)  # root before parent
    assert not _tokens.spells_chain(segs[-1], [anc[0], (3, *anc[1][1:])], toks)  # a level skipped
    assert not _tokens.spells_chain(segs[-1], [*anc, (3, *anc[-1][1:])], toks)  # a link past the root (a cycle)
    assert not _tokens.spells_chain(segs[-1], anc[:1], toks)  # the chain stops above token 0


def test_a_malformed_blob_past_a_mismatching_link_is_still_reported() -> None:
    toks = np.arange(3000, dtype="<u8")
    segs = [(_tokens.encode_tokens(toks[a:b])[0], 4, a, b) for a, b in ((0, 1000), (1000, 2000), (2000, 3000))]
    q = toks.copy()
    q[1500] += 1  # the parent differs
    assert not _tokens.spells_chain(segs[-1], _streamed(segs), q)
    segs[0] = (segs[0][0][:-1], 4, 0, 1000)  # and the root's blob cannot hold its tokens
    for check in (lambda: _tokens.spells_prefix(segs, q), lambda: _tokens.spells_chain(segs[-1], _streamed(segs), q)):
        with pytest.raises(ss.CorruptionError):
            check()


def test_a_candidate_whose_ancestor_differs_is_passed_over(tmp_path: str) -> None:
    """Its find key (forced) and own segment match the prompt; its parent does not: the next
    true prefix serves, and with that prefix gone, nothing does; a corrupt root is reported."""
    rng = np.random.default_rng(12)
    x = rng.integers(0, 50_000, 3000)
    q = np.concatenate([rng.integers(0, 50_000, 1000), x[1000:3000], rng.integers(0, 50_000, 300)])
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        for n in (1000, 2000, 3000):
            leaf = _save(s, x[:n])
        true = _save(s, q[:700], parent=None)
        _set_key(s, leaf.snapshot_id, int(find_keys(as_token_array(q))[3000 // BLOCK]))
        assert s.match(q).snapshot_id == true.snapshot_id
        s.delete(true.snapshot_id)
        assert s.match(q) is None
        root = s._repo.db.read(lambda c: c.chain(leaf.snapshot_id))[0]
        s._repo.db.write(lambda c: c.execute("UPDATE snapshots SET tokens = substr(tokens, 1, 8) WHERE id = ?",
                                             (root.id,)))
        with pytest.raises(ss.CorruptionError):
            s.match(q)


def test_match_holds_no_more_than_a_link_of_a_long_chain_at_once(tmp_path: str) -> None:
    """A hit over 40 links of 64 KiB each: the streamed check holds one link's blob at a time, not
    the chain's 2.5 MiB (holding them all faults in fresh pages on every match)."""
    rng = np.random.default_rng(13)
    links, per = 40, 16 * 1024
    toks = rng.integers(0, 50_000, links * per + 100)
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        for k in range(1, links + 1):
            leaf = _save(s, toks[:k * per])
        assert s.match(toks).snapshot_id == leaf.snapshot_id  # the thread's compare buffer, kept
        tracemalloc.start()
        try:
            assert s.match(toks).snapshot_id == leaf.snapshot_id
            _cur, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 8 * per * 4, peak  # a few links' blobs (64 KiB each), far below the chain's 2.5 MiB


def test_candidates_of_one_statement_come_longest_first(tmp_path: str) -> None:
    """One statement's candidates (here all in the deepest batch) are ordered by length, then by
    newest id, in Python: excluding each answer in turn walks them down in that order."""
    rng = np.random.default_rng(14)
    q = rng.integers(0, 50_000, 40 * BLOCK)
    lengths = [int(n) for n in rng.permutation(np.arange(30 * BLOCK, 40 * BLOCK, 97))]
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        ids = {_save(s, q[:n], parent=None).snapshot_id: n for n in lengths}
        first = next(iter(ids))
        twin = _save(s, q[:lengths[0]], parent=first).snapshot_id  # a delta of no tokens: same length, newer id
        order: list[int] = []
        while (m := s.match(q, exclude=order)) is not None:
            order.append(m.snapshot_id)
        want = sorted([*ids, twin], key=lambda sid: (ids.get(sid, lengths[0]), sid), reverse=True)
        assert order == want


def _random_chains(s: ss.Store, rng: np.random.Generator, cases: int, wide: Callable[[int], bool]) -> Iterator[
        tuple[int, int, list[_tokens.Segment], np.ndarray, _tokens.Encoded]]:
    """Random delta chains (int64 links where ``wide(case)`` and a coin say so) and prompts changed
    in one token below the leaf's own segment (by one, or by 2**32, which an int32 compare sees
    wrapped): ``(case, leaf id, the chain's segments, prompt, its Encoded)`` for every prompt whose
    own segment the leaf spells."""
    for case in range(cases):
        n = int(rng.integers(600, 4000))
        toks = rng.integers(0, 150_000, n)
        cuts = sorted({n, *rng.integers(1, n, int(rng.integers(2, 6))).tolist()})
        for b in cuts:
            if wide(case) and rng.random() < 0.3:  # an int64 link: a token the int32 width cannot hold
                toks[int(rng.integers(max(0, b - 50), b))] = 2**40 + case
        leaf = None
        for b in cuts:
            leaf = _save(s, toks[:b], parent=leaf if leaf is not None else None)
        assert leaf is not None
        sid = leaf.snapshot_id
        segs = s._repo.db.read(lambda c, sid=sid: c.chain_tokens(sid))
        variants = [toks.astype("<u8")]
        for _ in range(6):
            v = toks.astype("<u8")
            v[int(rng.integers(0, segs[-1][2]))] += 1 if rng.random() < 0.5 else 2**32
            variants.append(v)
        for q in variants:
            enc = _tokens.Encoded(q)
            if _tokens.spells_segment(segs[-1], q, enc):
                yield case, sid, segs, q, enc


def test_links_compared_in_sql_answer_as_their_blobs_do(tmp_path: str) -> None:
    """chain_links compares links of the bound width inside SQLite and hands back the blobs of the
    others: over random chains mixing int32 and int64 links, and prompts changed in one token (by
    one, or by 2**32, which an int32 compare would see wrapped), the answer is the whole-chain check's."""
    checked = 0
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        for case, sid, segs, q, enc in _random_chains(s, np.random.default_rng(21), 12, lambda case: True):
            w = segs[-1][1]
            got = s._repo.db.read(lambda c, q=q, enc=enc, w=w, sid=sid, segs=segs: _tokens.spells_chain(
                segs[-1], c.chain_links(sid, 1, w, memoryview(enc.width(w))[:segs[-1][2] * w]), q, enc))
            assert got == _tokens.spells_prefix(segs, q), case
            checked += 1
    assert checked > 50


def test_a_prompt_token_past_int32_never_matches_an_int32_link_it_wraps_to(tmp_path: str) -> None:
    """The int32 root holds token 5 where the prompt has 2**32 + 5: the prompt encoded in int32
    wraps to the same bytes, so SQLite's compare says equal; with the find keys forced to the
    prompt's (a collision), the chain must still not match."""
    toks = np.arange(3000, dtype=np.int64) % 50_000
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        root = _save(s, toks[:1000])
        leaf = _save(s, toks[:3000])
        q = toks.astype("<u8")
        q[500] += 2**32
        keys = find_keys(q)
        _set_key(s, root.snapshot_id, int(keys[1000 // BLOCK]))
        _set_key(s, leaf.snapshot_id, int(keys[3000 // BLOCK]))
        assert s.match(q) is None
        assert s.match(toks[:3000]) is None  # (the keys are forced: the true prompt finds nothing)
        _set_key(s, leaf.snapshot_id, int(find_keys(as_token_array(toks))[3000 // BLOCK]))
        assert s.match(toks).snapshot_id == leaf.snapshot_id


def test_the_one_statement_chain_check_never_says_yes_where_the_exact_check_says_no(tmp_path: str) -> None:
    """``Txn.chain_spells`` (match()'s fast path, one aggregate statement) over random chains mixing
    int32 and int64 links and prompts changed in one token (by one, or by 2**32, which an int32
    compare sees wrapped): a yes is always the exact check's yes, and on a chain of one width it
    answers exactly as the exact check does (the fast path is what the usual hit takes)."""
    agreed = mixed = 0
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        for case, sid, segs, q, enc in _random_chains(s, np.random.default_rng(31), 14, lambda case: case % 2 == 1):
            w = segs[-1][1]
            below = memoryview(enc.width(w))[:segs[-1][2] * w]
            fast = s._repo.db.read(lambda c, enc=enc, w=w, below=below, sid=sid: c.chain_spells(
                sid, w, below, enc.narrow()))
            exact = _tokens.spells_prefix(segs, q)
            assert exact or not fast, case
            if len({width for _, width, _, _ in segs}) == 1:
                assert fast == exact, case
                agreed += 1
            else:
                mixed += 1
    assert agreed > 30 and mixed > 5


def test_the_one_statement_chain_check_leaves_a_malformed_link_to_the_exact_check(tmp_path: str) -> None:
    """An ancestor whose token blob is cut short: the fast path says no, and match() still reports
    the chain as corrupt through the exact check (as before the fast path existed)."""
    toks = np.arange(3000, dtype=np.int64) % 50_000
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        root = _save(s, toks[:1000])
        leaf = _save(s, toks[:3000])
        assert s.match(toks).snapshot_id == leaf.snapshot_id
        s._repo.db.write(lambda c: c.execute("UPDATE snapshots SET tokens = substr(tokens, 1, 40) WHERE id = ?",
                                             (root.snapshot_id,)))
        enc = _tokens.Encoded(toks.astype("<u8"))
        below = memoryview(enc.width(4))[:1000 * 4]
        assert not s._repo.db.read(lambda c: c.chain_spells(leaf.snapshot_id, 4, below, enc.narrow()))
        with pytest.raises(ss.CorruptionError):
            s.match(toks)


def test_the_one_statement_chain_check_walks_no_link_the_exact_check_would_not(tmp_path: str) -> None:
    """A leaf whose depth reads below 0 (a damaged row): the exact walk gives it no links, so it
    does not spell the prompt and the root serves; the fast path must not walk its chain either."""
    toks = np.arange(3000, dtype=np.int64) % 50_000
    with open_store(os.path.join(tmp_path, "s"), layout=TINY) as s:
        root = _save(s, toks[:1000])
        leaf = _save(s, toks[:3000])
        s._repo.db.write(lambda c: c.execute("UPDATE snapshots SET depth = -1 WHERE id = ?", (leaf.snapshot_id,)))
        enc = _tokens.Encoded(toks.astype("<u8"))
        below = memoryview(enc.width(4))[:1000 * 4]
        assert not s._repo.db.read(lambda c: c.chain_spells(leaf.snapshot_id, 4, below, enc.narrow()))
        assert s.match(toks).snapshot_id == root.snapshot_id
