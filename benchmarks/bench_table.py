"""The one current table that opens docs/benchmarks.md (issue 31 item 4), from a run's figures.

``bench.py --doc docs/benchmarks.md`` (what ``make bench`` runs) replaces the text between the
``<!-- current-table -->`` markers with :func:`table` of the figures just measured; sections not
run show a dash. ``--vllm-json`` adds the vLLM peers from a ``bench_vllm.py --json`` file.
"""

from __future__ import annotations

import re
from typing import Any

BEGIN, END = "<!-- current-table:begin -->", "<!-- current-table:end -->"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def table(res: dict[str, Any], meta: dict[str, Any], vllm: dict[str, Any] | None = None) -> str:
    """Markdown: what was measured, our figure, the baseline measured beside it, the ratio, the target."""
    rows: list[tuple[str, str, str, str, str]] = []
    core = res.get("core")
    if core and "raw_cold_best" in core["GBps"]:  # issue 48: the defaults first, ram_bytes=0 beside, best raw baselines
        g, r, mib = core["GBps"], core["ratios"], core["bytes"] / (1 << 20)

        def best(kind: str) -> str:
            b, d = g[f"raw_{kind}"], g[f"raw_{kind}_direct"]
            what = "write + fsync" if kind == "write" else "read cold"
            return f"raw {what} {max(b, d):.2f} GB/s ({'O_DIRECT' if d > b else 'buffered'}; the other {min(b, d):.2f})"

        settle = core.get("settle_s")
        cold_when = f" (read {settle:g} s after its write)" if settle else ""
        rows += [
            (f"large save, {mib:.0f} MiB, defaults", f"{g['save']:.2f} GB/s (ram=0: {g['save_ram0']:.2f})",
             best("write"), f"{_x(r['save'])} (ram=0: {_x(r['save_ram0'])})", "≥ 0.9x"),
            (f"large restore, cold{cold_when}, {mib:.0f} MiB, defaults", f"{g['restore_cold']:.2f} GB/s "
             f"(ram=0: {g['restore_cold_ram0']:.2f})", best("cold"),
             f"{_x(r['restore_cold'])} (ram=0: {_x(r['restore_cold_ram0'])})", "≥ 0.9x"),
            (f"large restore, 1st warm, {mib:.0f} MiB, defaults", f"{g['restore_warm']:.2f} GB/s "
             f"(ram=0: {g['restore_warm_ram0']:.2f})", f"raw read warm {g['raw_warm']:.2f} GB/s",
             f"{_x(r['restore_warm'])} (ram=0: {_x(r['restore_warm_ram0'])})", "≥ 0.9x"),
            (f"large restore, later warm, {mib:.0f} MiB, defaults (RAM tier)", f"{g['restore_ram']:.2f} GB/s",
             f"raw read warm {g['raw_warm']:.2f} GB/s", _x(r["restore_ram"]), "≥ 0.9x"),
        ]
    elif core:  # a run from before issue 48 (--table-from an older --json): ram=0, buffered baselines
        g, r, mib = core["GBps"], core["ratios"], core["bytes"] / (1 << 20)
        rows += [
            (f"large save, {mib:.0f} MiB", f"{g['save']:.2f} GB/s", f"raw write + fsync {g['raw_write']:.2f} GB/s",
             _x(r["save"]), "≥ 0.8x"),
            (f"large restore, cold, {mib:.0f} MiB", f"{g['restore_cold']:.2f} GB/s",
             f"raw read cold {g['raw_cold']:.2f} GB/s", _x(r["restore_cold"]), "≥ 0.8x"),
            (f"large restore, warm, {mib:.0f} MiB", f"{g['restore_warm']:.2f} GB/s",
             f"raw read warm {g['raw_warm']:.2f} GB/s", _x(r["restore_warm"]), "≥ 0.8x"),
            (f"large restore, RAM tier, {mib:.0f} MiB", f"{g['restore_ram']:.2f} GB/s",
             f"raw read warm {g['raw_warm']:.2f} GB/s", _x(r["restore_ram"]), "—"),
        ]
    alt = res.get("alt")
    if alt and core:
        g = core["GBps"]
        for k, label, ours in (("st_cold", "safetensors load + copy, cold", "restore_cold"),
                               ("pt_cold", "torch.load + copy, cold", "restore_cold"),
                               ("st_save", "safetensors save + fsync", "save")):
            if k in alt:
                rows.append((f"peer: {label}", f"snapstore {g[ours]:.2f} GB/s", f"{alt[k]['GBps']:.2f} GB/s",
                             _x(g[ours] / alt[k]["GBps"]) + " of it", "ahead"))
    small = res.get("small")
    if small:
        for key, r in small["restore"].items():
            mib = r["bytes"] / (1 << 20)
            what = f"small restore, {r['tokens']} tokens ({mib:.0f} MiB), {r['links']} link{'s' * (r['links'] > 1)}"
            if "steady_floor_x" in r:  # issue 48: against the floor (raw read + XXH3), cold / warm / steady
                busy = "ram_busy" in r  # runs before issue 48's sixth pass timed the defaults only back to back
                rows.append((what + ": cold / warm / steady; defaults (RAM tier)"
                             + (" steady, and back to back from the first restore" if busy else ""),
                             f"{r['cold']:.2f} / {r['warm']:.2f} / {r['steady']:.3f} ms; {r['ram']:.3f} ms"
                             + (f", {r['ram_busy']:.3f} ms" if busy else ""),
                             f"floor {r['floor_cold']:.2f} / {r['floor_warm']:.2f} / {r['floor_steady']:.3f} ms "
                             f"(raw read {r['raw_cold']:.2f} / {r['raw_warm']:.2f} / {r['raw_steady']:.3f})",
                             f"{r['cold_floor_x']:.2f} / {r['warm_floor_x']:.2f} / {r['steady_floor_x']:.2f}; "
                             f"{r['ram_floor_x']:.2f}" + (f", {r['ram_busy_floor_x']:.2f}" if busy else "")
                             + " of the floor",
                             "≥ 0.9x" if r["links"] == 1 else "≥ 0.7x"))
                continue
            if r["tokens"] not in (1024, 3072, 8192) or (r["links"] != 12 and r["tokens"] != 3072):
                continue  # a run from before issue 48 (--table-from an older --json)
            rows.append((what + ", warm", f"{r['warm']:.2f} ms", f"raw read warm {r['raw_warm']:.2f} ms",
                         _x(r["warm_x"]), "≤ 2 ms at 3K/12" if key == "3072/12" else "—"))
            if "steady" in r:  # runs before issue 31's sixth pass timed the first warm restore only
                rows.append((what + ", warm, steady", f"{r['steady']:.2f} ms",
                             f"raw read steady {r['raw_steady']:.2f} ms", _x(r["steady_x"]), "—"))
            rows.append((what + ", cold", f"{r['cold']:.2f} ms", f"raw read cold {r['raw_cold']:.2f} ms",
                         _x(r["cold_x"]), "—"))
        lk = small.get("lookup", {})
        if "lookup" in lk:
            base = lk.get("match+describe", {}).get("p50_us")
            rows.append(("scheduler lookup (Store.lookup), 3K tokens, 12 links", f"p50 {lk['lookup']['p50_us']:.0f} us",
                         f"match + describe p50 {base:.0f} us" if base else "—",
                         "—", "≤ 500 us p50"))
        if "lookup, list, weighed" in lk:  # runs before the seventh pass of issue 31 did not time it
            rows.append(("the same as the vLLM connector calls it (a list prompt, weighed against prefill)",
                         f"p50 {lk['lookup, list, weighed']['p50_us']:.0f} us", "—", "—", "—"))
    match = res.get("match")
    if match:
        rows.append((f"match() over {match['snapshots']:,} snapshots, 128K-token prompts",
                     f"p50 {match['median_us']:,.0f} us", f"miss {match['miss_us']:,.0f} us", "—", "≤ 1 ms"))
    if vllm:
        t = vllm["ttft_s"]
        rows.append((f"vLLM TTFT, {vllm['long_tokens']} tokens restored (tiny Llama, CPU)",
                     f"snapstore {t['snapstore_restored'] * 1e3:.1f} ms",
                     f"ExampleConnector {t['example_restored'] * 1e3:.1f} ms; prefill {t['prefill'] * 1e3:.1f} ms",
                     _x(t["snapstore_restored"] / t["example_restored"]) + " of it", "≤ 1.0x"))
        w, sch = _get(vllm, "snapstore_connector", "worker"), _get(vllm, "snapstore_connector", "scheduler")
        per = vllm.get("snapstore_per_request_us")
        if per:  # each restored request's own (bench_vllm.py since issue 31's eighth pass)
            each = per.get("lookup_each") or []
            mean = f", mean {sum(each) / len(each):.0f} us" if each else ""
            rows.append(("vLLM connector, inside the served process, per restored request",
                         f"lookup p50 {per['lookup_p50']:.0f} us{mean}, load p50 {per['load_p50'] / 1e3:.2f} ms",
                         f"{per['requests']} requests", "—", "lookup ≤ 300 us mean"))
        elif w and sch and w.get("loads") and sch.get("lookups"):
            rows.append(("vLLM connector, inside the served process", f"load {w['load_us'] / w['loads'] / 1e3:.1f} ms, "
                         f"lookup {sch['lookup_us'] / sch['lookups'] / 1e3:.1f} ms a request", "—", "—", "—"))
    path = res.get("read_path")
    chosen = ""
    if path:  # issue 48: which cold-read path the store chose there, and why
        how = path["method"] if path["method"] == "buffered" else f"O_DIRECT {path['threads']}x{path['piece'] >> 20}MiB"
        chosen = f" Cold reads: {how}, chosen by the store's measurement: {path['why']}."
        core = res.get("core") or {}
        if core.get("chosen_after"):  # the store's own cold restores time the path and may change it
            chosen += (f" Cold reads {core.get('settle_s', 0):g} s after the write; the defaults' path after each "
                       f"cold restore: {', '.join(core['chosen_after'])} (last: {core.get('chosen_why', '')}).")
    out = [f"Current figures: `{meta['command']}` on {meta['when']} — {meta['machine']}; load average "
           f"{meta['load_before']} before, {meta['load_after']} after (other work ran beside it: read the ratios)."
           + (f" vLLM row: `bench_vllm.py` at load {vllm['load'][0]:.1f}." if vllm else "") + chosen,
           "", "| measured | snapstore | baseline, same run | ratio | target |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(out) + "\n"


def update_doc(path: str, text: str) -> None:
    """Replace the block between the markers in ``path`` (added after the title when absent)."""
    with open(path) as f:
        doc = f.read()
    block = f"{BEGIN}\n{text}{END}"
    if BEGIN in doc and END in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: block, doc, count=1, flags=re.S)
    else:
        head, _, rest = doc.partition("\n")
        doc = f"{head}\n\n{block}\n{rest}"
    with open(path, "w") as f:
        f.write(doc)
