"""A fleet node in its own process, for the shared-tier tests: save or restore, print JSON lines.

usage: python remote_node.py '{"op": "save"|"restore"|"loop", "dir": ..., "url": ..., ...}'
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remote_helpers import LAYOUT, identity, state  # noqa: E402

import snapstore  # noqa: E402


def main() -> None:
    a = json.loads(sys.argv[1])
    cb = a.get("chunk_bytes", 65536)
    store = snapstore.Store.open(a["dir"], identity=identity(), layout=LAYOUT, remote=a["url"],
                                 remote_wait=a.get("wait", False), chunk_bytes=cb, staging_bytes=cb * 4)
    ns = a.get("namespace")
    if a["op"] == "save":
        tokens, kv, st = state(a["seed"], max(a["lengths"]))
        if a.get("start_at"):  # two nodes saving the same prefix at the same moment
            while time.time() < a["start_at"]:
                time.sleep(0.001)
        out = [store.save(tokens[:n], {"st": st + n, "kv": kv}, rows=n, namespace=ns).snapshot_id
               for n in a["lengths"]]
        f = store.flush()
        store.close()
        print(json.dumps({"saved": out, "uploaded": f.uploaded, "failed": f.failed, "errors": f.errors}))
    elif a["op"] == "restore":
        tokens, kv, st = state(a["seed"], a["n_max"])
        m = store.match(list(tokens[:a["n"]]) + [7, 7, 7], namespace=ns)
        if m is None:
            store.close()
            print(json.dumps({"match": None}))
            return
        dest_kv = kv.copy()
        dest_kv[:] = 0
        dest_st = st.copy()
        dest_st[:] = 0
        res = store.restore(m, {"st": dest_st, "kv": dest_kv})
        store.flush()  # the default restore imports the chain in the background
        again = store.match(list(tokens[:a["n"]]) + [7, 7, 7], namespace=ns)
        store.close()
        print(json.dumps({"match": m.n_tokens, "remote": type(m).__name__ == "RemoteMatch",
                          "local_after": type(again).__name__ == "Match" and again.n_tokens == m.n_tokens,
                          "rows": res.rows, "kv": hashlib.sha256(dest_kv[:m.n_tokens].tobytes()).hexdigest(),
                          "st": hashlib.sha256(dest_st.tobytes()).hexdigest()}))
    elif a["op"] == "loop":  # the kill campaign's victim: save chains and upload until killed
        print(json.dumps({"ready": True}), flush=True)
        seed = a["seed"]
        while True:
            tokens, kv, st = state(seed, max(a["lengths"]))
            for n in a["lengths"]:
                store.save(tokens[:n], {"st": st + n, "kv": kv}, rows=n)
            store.flush()
            print(json.dumps({"acked": seed}), flush=True)
            seed += 1


if __name__ == "__main__":
    main()
