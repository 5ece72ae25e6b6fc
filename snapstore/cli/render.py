"""The ``snapstore`` commands' text output: trees, details and summaries drawn from the JSON documents.

Every function renders the same object the command prints with ``--json`` (so text and JSON never
disagree) and writes lines through the run's :class:`CliContext`. Nothing here reads the store.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from snapstore._config import MIB
from snapstore.console.context import CliContext
from snapstore.console.progress import human_bytes

__all__ = ["gc", "inspect_all", "inspect_one", "remote_counters", "remote_gc", "remote_inspect", "remote_stats",
           "remote_verify", "stats", "verify", "verify_status"]


def _ago(t: float, now: float) -> str:
    d = now - t
    if d < 0:
        return "in the future"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= span:
            return f"{int(d // span)}{unit} ago"
    return f"{int(d)}s ago"


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _pinned_by(names: list[str]) -> str:
    """What pins a snapshot: its names (Store.name) — a snapshot with children is not "pinned"."""
    return f"pinned by name{'s' if len(names) > 1 else ''} " + ", ".join(repr(n) for n in names)


def _snap_line(d: dict[str, Any], now: float) -> str:
    """One snapshot on one line of a tree."""
    bits = [f"#{d['id']}", f"{d['n_tokens']} tok"]
    if d["rows"]:
        bits.append(" ".join(f"{k}={v}" for k, v in sorted(d["rows"].items())))
    if d["components"]:
        bits.append("+" + ",".join(d["components"]))
    bits.append(f"{human_bytes(d['logical_bytes'])} logical / {human_bytes(d['stored_bytes'])} stored")
    flags = []
    if d["pending"]:
        flags.append("pending")
    if d.get("imported_from"):
        flags.append(f"imported under an identity override from {d['imported_from']} (never matched)")
    if d["quarantined"]:
        flags.append("quarantined (not matched until a save heals it)")
    elif not d["matchable"] and not d.get("imported_from"):
        flags.append("superseded")
    if d.get("names"):
        flags.append(_pinned_by(d["names"]))
    if d["children"]:
        flags.append("has children")
    if flags:
        bits.append(", ".join(flags))
    if d["session"] is not None:
        bits.append(f"session={d['session']}")
    bits.append(f"used {_ago(d['last_used'], now)}")
    bits.append(f"hits {d['hits']}")
    return "  ".join(bits)


def inspect_all(doc: dict[str, Any], out: CliContext) -> None:
    """``inspect``: per identity and namespace the snapshots as trees, then the totals."""
    now = time.time()
    by_id = {d["id"]: d for d in doc["snapshots"]}
    tee, ell, bar = ("├── ", "└── ", "│   ") if out.unicode else ("|-- ", "`-- ", "|   ")
    out.line(f"store {doc['dir']}")
    if not doc["identities"]:
        out.line("  (no identities: nothing has opened this store for an engine yet)")
    drawn: set[int] = set()
    for ident in doc["identities"]:
        fields = ident["fields"]  # a dict "extra" is drawn last, as extra.KEY=VALUE
        extra = fields["extra"] if isinstance(fields.get("extra"), dict) else {}
        desc = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in fields.items()
                        if not (k == "extra" and isinstance(v, dict)))
        desc += "".join(f" extra.{k}={v}" for k, v in extra.items())
        out.line()
        out.line(f"identity {ident['key']}  {desc}")
        out.line(f"  {ident['snapshots']} snapshots; created {_stamp(ident['created'])}, "
                 f"last opened {_ago(ident['last_open'], now)}")
        for ns in ident["namespaces"]:
            out.line(f"  namespace {ns['namespace'] if ns['namespace'] is not None else '(default)'}: "
                     f"{ns['snapshots']} snapshots")
            # iterative depth-first walk (chains can be thousands deep)
            stack: list[tuple[int, str, str]] = [(r, "    ", "") for r in reversed(ns["roots"])]
            while stack:
                sid, prefix, connector = stack.pop()
                d = by_id[sid]
                drawn.add(sid)
                out.line(prefix + connector + _snap_line(d, now))
                child_prefix = prefix + ("" if not connector else (bar if connector == tee else "    "))
                children = [k for k in d["children"] if k in by_id]
                for i, k in reversed(list(enumerate(children))):
                    stack.append((k, child_prefix, ell if i == len(children) - 1 else tee))
        for nm in ident.get("names", []):
            until = "" if nm["expires"] is None else (
                f", expires in {_ago(now, nm['expires'])[:-4]}" if nm["expires"] > now else ", expired")
            where = f" (namespace {nm['namespace']})" if nm["namespace"] is not None else ""
            out.line(f"  name {nm['name']!r}{where} -> #{nm['snapshot_id']}{until}")
    rest = [d for d in doc["snapshots"] if d["id"] not in drawn]
    if rest:
        out.line()
        out.line("snapshots outside any tree (their identity or parent is missing: run `snapstore verify`):")
        for d in rest:
            out.line("    " + _snap_line(d, now))
    t = doc["totals"]
    out.line()
    out.line(f"totals: {t['snapshots']} snapshots ({t['entries']} matchable, {t['pending']} pending), "
             f"{t['chunks']} chunks, {t['identities']} identities")
    out.line(f"  logical {human_bytes(t['logical_bytes'])}, referenced {human_bytes(t['referenced_bytes'])}, "
             f"stored {human_bytes(t['stored_bytes'])}; dedup {t['dedup_ratio']:.2f}x, "
             f"logical/stored {t['logical_ratio']:.2f}x")


def inspect_one(doc: dict[str, Any], out: CliContext) -> None:
    """``inspect ID``: the snapshot's fields, its chain and each part with its chunks."""
    now = time.time()
    d = doc["snapshot"]
    arrow = " → " if out.unicode else " -> "
    out.line(f"snapshot #{d['id']}  identity {d['identity']}  namespace "
             f"{d['namespace'] if d['namespace'] is not None else '(default)'}  session {d['session']}")
    state = "pending" if d["pending"] else "committed"
    state += (", matchable" if d["matchable"] else ", quarantined: reads a damaged chunk, not matched until a save "
              "of the same state heals it" if d["quarantined"] else
              f", imported under an identity override from {d['imported_from']}: restored by id or name, never "
              "matched" if d.get("imported_from") else ", superseded (a chain link only)")
    if d.get("names"):
        state += ", " + _pinned_by(d["names"]) + " (never evicted or expired while named)"
    if d["children"]:
        state += ", has children: " + ", ".join(f"#{k}" for k in d["children"]) + " (not evicted while it has)"
    out.line(f"  tokens {d['n_tokens']} (this segment {d['base_tokens']}..{d['n_tokens']}), depth {d['depth']}, "
             f"parent {'#' + str(d['parent_id']) if d['parent_id'] is not None else '-'}")
    out.line(f"  {state}")
    out.line(f"  created {_stamp(d['created'])}, last used {_ago(d['last_used'], now)}, hits {d['hits']}")
    out.line(f"  bytes: logical {human_bytes(d['logical_bytes'])}, this segment {human_bytes(d['segment_bytes'])}"
             f" raw, stored {human_bytes(d['stored_bytes'])} (only this snapshot: {human_bytes(d['exclusive_bytes'])})")
    out.line("  chain: " + arrow.join(f"#{x['id']} [{x['base_tokens']},{x['n_tokens']})" for x in d["chain"]))
    out.line("  parts:")
    for p in d["parts"]:
        span = f"rows {p['row_start']}..{p['row_end']}" if p["kind"] == "rows" else "fixed"
        comp = f"  component {p['component']}" if p["component"] else ""
        out.line(f"    {p['name']}  {p['dtype']}{tuple(p['shape'])}  {span}  {human_bytes(p['nbytes'])}"
                 f"{comp}  {p['chunk_count']} chunk{'' if p['chunk_count'] == 1 else 's'}")
        for ch in p["chunks"]:
            if ch is None:
                out.line("      (missing chunk row: run `snapstore verify`)")
            else:
                out.line(f"      {ch['id'][:16]}…  raw {ch['raw_len']}  stored {ch['stored_len']}  "
                         f"{ch['codec']}  refs {ch['refs']}" if out.unicode else
                         f"      {ch['id'][:16]}...  raw {ch['raw_len']}  stored {ch['stored_len']}  "
                         f"{ch['codec']}  refs {ch['refs']}")


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(f"#{i}" for i in ids) if ids else "none"


def _checked(deep: bool) -> str:
    """What a verify of this kind looked at, for its verdict line."""
    if deep:
        return "deep: SQLite integrity, chains, accounting, and every chunk re-read and re-hashed"
    return ("quick: SQLite integrity, chains, accounting, and each chunk file's presence, size and header; "
            "chunk contents were not read: `snapstore verify --deep` re-hashes them")


def verify(doc: dict[str, Any], out: CliContext, repair: bool) -> None:
    """``verify``: what was checked, each damaged snapshot with its problems, leftovers, the verdict."""
    sqlite_errors = doc["sqlite_errors"]
    kind = "deep" if doc["deep"] else "quick"
    out.line(f"verify ({kind}) {doc['dir']}: checked {doc['checked_chunks']} chunks "
             f"({human_bytes(doc['checked_bytes'])})")
    for e in sqlite_errors:
        out.line(f"  sqlite: {e}")
    affected = set(doc["affected_snapshots"])
    for item in doc["damage"]:
        out.line(f"  damaged snapshot #{item['snapshot']}:")
        for why in item["problems"]:
            out.line(f"    - {why}")
    below = sorted(affected - {i["snapshot"] for i in doc["damage"]})
    if below:
        out.line(f"  their chains also carry: {_ids(below)}")
    attributed = {why for item in doc["damage"] for why in item["problems"]}
    other = [p for p in doc["problems"] if not p.startswith("snapshot ") and p not in attributed]
    for p in other:
        out.line(f"  problem: {p}")
    for label, key in (("orphan chunk files", "orphan_files"), ("temp files", "temp_files")):
        if doc[key]:
            out.line(f"  {label} (not damage; `snapstore gc` removes them): {len(doc[key])}")
            for f in doc[key][:20]:
                out.line(f"    {f}")
            if len(doc[key]) > 20:
                out.line(f"    ... {len(doc[key]) - 20} more")
    if doc["dead_pending"]:
        out.line(f"  pending captures of dead processes (gc removes them): {_ids(doc['dead_pending'])}")
    if doc["status"] == "clean":
        if doc["removed_files"]:
            out.line(f"  removed {len(doc['removed_files'])} orphan/temp files older than the grace period")
        out.line(f"CLEAN: no damage found ({_checked(doc['deep'])})")
    elif doc["status"] == "repaired":
        out.line(f"REPAIRED: removed {len(doc['removed_snapshots'])} snapshots ({_ids(doc['removed_snapshots'])})"
                 + (f", pruned chain links {_ids(doc['pruned_snapshots'])}" if doc["pruned_snapshots"] else "")
                 + f", {len(doc['removed_files'])} orphan/temp files")
        out.line("  the store now verifies clean" if doc["clean_after_repair"] else
                 "  the store still does not verify clean: run `snapstore verify` again")
    else:
        hint = "" if repair else "; `snapstore verify --repair` removes the affected snapshots"
        if sqlite_errors:
            hint = "; the SQLite database itself is damaged (--repair cannot fix that: restore it or remove the store)"
        out.line(f"DAMAGE FOUND: {len(doc['damaged_snapshots'])} damaged snapshots, "
                 f"{len(doc['affected_snapshots'])} affected{hint}")


_LISTED = 20  # files a text report lists per kind before "... N more" (--verbose: all)


def gc(doc: dict[str, Any], out: CliContext, verbose: bool = False) -> None:
    """``gc``: what was (or would be) removed and why, then the bytes freed. Files are counted; a dry
    run lists the first :data:`_LISTED` of each kind, ``verbose`` every one (the JSON always has all)."""
    dry = doc["dry_run"]
    verb = "would remove" if dry else "removed"
    out.line(f"gc {doc['dir']}" + (" (dry run: nothing was changed)" if dry else ""))
    for label, key in (("pending captures of dead processes", "dead_pending"),
                       ("snapshots of stale identities", "stale"),
                       ("expired snapshots (ttl)", "expired"),
                       ("evicted snapshots (LRU leaves, to the budget)", "evicted")):
        if doc[key]:
            out.line(f"  {label}: {_ids(doc[key])}")
    pruned = sorted(set(doc["removed_snapshots"]) - set(doc["dead_pending"]) - set(doc["stale"])
                    - set(doc["expired"]) - set(doc["evicted"]))
    if pruned:
        out.line(f"  chain links left without a purpose: {_ids(pruned)}")
    for label, key in (("chunk files no snapshot uses any more", "chunk_files"),
                       ("orphan chunk files", "orphan_files"), ("temp files", "temp_files")):
        files = doc[key]
        if files:
            out.line(f"  {label}: {len(files)}")
            if dry or verbose:
                shown = files if verbose else files[:_LISTED]
                for f in shown:
                    out.line(f"    {f}")
                if len(shown) < len(files):
                    out.line(f"    ... {len(files) - len(shown)} more (--verbose lists them all)")
    out.line(f"{verb} {len(doc['removed_snapshots'])} snapshots, "
             f"{len(doc['chunk_files']) + len(doc['orphan_files']) + len(doc['temp_files'])} files, "
             f"{human_bytes(doc['bytes_freed'])}; stored {human_bytes(doc['stored_bytes_before'])} -> "
             f"{human_bytes(doc['stored_bytes_after'])}")


def stats(root: str, d: dict[str, Any], out: CliContext) -> None:
    """``stats``: one aligned line per counter."""
    lookups = d["hits"] + d["misses"]
    rate = f" ({100 * d['hits'] / lookups:.1f}% hit rate)" if lookups else ""
    rows = [
        ("entries", f"{d['entries']} matchable ({d['snapshots']} snapshots, {d['pending']} pending)"),
        ("hits / misses", f"{d['hits']} / {d['misses']}{rate}"),
        ("hit tokens", f"{d['hit_tokens']} tokens served from the store"),
        ("restores", str(d["restores"])),
        ("inserts", str(d["inserts"])),
        ("evictions", str(d["evictions"])),
        ("supersedes", str(d["supersedes"])),
        ("expired", str(d["expired"])),
        ("abandoned", str(d["abandoned"])),
        ("stale dropped", str(d["stale_dropped"])),
        ("quarantined", f"{d['quarantined']} chunks now (damage a restore found; a save of the same state heals, "
                        "`snapstore verify --repair` drops)"),
        ("healed", f"{d['healed']} chunks republished by a save"),
        ("skipped saves", ", ".join(f"{k}={v}" for k, v in sorted(d["skipped"].items())) or "0"),
        ("stored", f"{human_bytes(d['stored_bytes'])} in {d['chunks']} chunks "
                   f"(disk budget {human_bytes(d['disk_budget'])})"),
        ("logical", f"{human_bytes(d['logical_bytes'])}; dedup {d['dedup_ratio']:.2f}x"),
        ("ram tier hits", str(d["ram_hits"])),
        ("recompute", f"{d.get('recompute_skipped', 0)} matches passed over a restore slower than reading; "
                      f"restores saved {d.get('restore_saved_s', 0.0):.3f} s"),
        ("restore rates", ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in sorted(d.get("restore_rates", {}).items()))
                          or "none measured yet"),
    ]
    out.line(f"stats {root}")
    for k, v in rows:
        out.line(f"  {k:<14} {v}")


def remote_counters(counters: dict[str, int], out: CliContext) -> None:
    """``stats``/``inspect --remote``: this node's traffic with the shared tier, after the local report."""
    out.line("  shared tier, this node: " + (", ".join(f"{k[7:]}={v}" for k, v in sorted(counters.items()))
                                             or "no traffic yet"))


# -- --remote: the shared tier ---------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def remote_verify(doc: dict[str, Any], out: CliContext) -> None:
    """``verify --remote``: the verdict, the tier's counts, each damaged manifest or chunk, what was removed."""
    out.line(f"verify --remote {doc['url']}{' (deep)' if doc['deep'] else ''}: {doc['status']}")
    out.line(f"  {doc['manifests']} manifests, {doc['chunks']} chunk objects ({_mib(doc['chunk_bytes'])}), "
             f"{doc['orphan_chunks']} unreferenced (gc --remote collects them), {doc['live_leases']} live uploads")
    for d in doc["damaged_manifests"]:
        out.line(f"  damaged manifest {d['manifest']}: {d['reason']}")
    for c in doc["corrupt_chunks"]:
        out.line(f"  corrupt chunk {c['chunk']}: {c['reason']}")
    for r in doc["repaired"]:
        out.line(f"  removed {r}")


def remote_gc(doc: dict[str, Any], out: CliContext) -> None:
    """``gc --remote``: manifests evicted or broken, then objects and bytes freed."""
    dry = doc["dry_run"]
    out.line(f"gc --remote {doc['url']}" + (" (dry run: nothing was changed)" if dry else ""))
    if doc["evicted_manifests"]:
        out.line(f"  evicted manifests (LRU leaves, to the budget): {len(doc['evicted_manifests'])}")
    if doc["broken_manifests"]:
        out.line(f"  manifests of broken chains: {len(doc['broken_manifests'])}")
    out.line(f"{'would remove' if dry else 'removed'} {len(doc['evicted_manifests']) + len(doc['broken_manifests'])} "
             f"manifests, {doc['chunks_removed']} chunk objects, {doc['leases_removed']} stale leases, "
             f"{_mib(doc['bytes_freed'])}; {_mib(doc['bytes_before'])} -> {_mib(doc['bytes_after'])}"
             + (f"; {doc['kept_for_leases']} kept for live uploads" if doc["kept_for_leases"] else ""))


def remote_stats(remote: dict[str, Any], out: CliContext) -> None:
    """``stats --remote``: the shared tier's totals (after the local store's stats)."""
    out.line(f"shared tier {remote['url']}")
    out.line(f"  {'manifests':<14} {remote['manifests']} in {remote['scopes']} scopes")
    out.line(f"  {'chunks':<14} {remote['chunks']} objects, {_mib(remote['chunk_bytes'])}")
    out.line(f"  {'uploads':<14} {remote['leases']} in flight (leases)")


def remote_inspect(remote: dict[str, Any], out: CliContext) -> None:
    """``inspect --remote``: per scope its manifests (tokens, bytes, last use, parent)."""
    now = time.time()
    out.line(f"shared tier {remote['url']}: {remote['chunks']} chunk objects, {_mib(remote['chunk_bytes'])}")
    for sc in remote["scopes"]:
        out.line(f"  scope {sc['scope'][:12]} identity {sc['identity']}"
                 + (f" namespace {sc['namespace']!r}" if sc["namespace"] else ""))
        for e in sc["manifests"]:
            if "damaged" in e:
                out.line(f"    {e['manifest']}  DAMAGED: {e['damaged']}")
                continue
            parent = f" <- {e['parent'].split('/')[1][:12]}" if e["parent"] else ""
            out.line(f"    {e['n_tokens']:>8} tokens  {_mib(e['stored_bytes']):>10}  used {int(now - e['last_used'])}s "
                     f"ago  {e['manifest'].split('/')[1][:12]}{parent}" + ("" if e["matchable"] else "  (chain link)"))


def verify_status(ok: bool, repaired: bool) -> str:
    """The ``status`` of a verify (local or shared tier): clean, repaired or damaged."""
    return "clean" if ok else ("repaired" if repaired else "damaged")
