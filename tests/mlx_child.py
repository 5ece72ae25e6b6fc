"""A process that runs PrefixCache calls on the tiny MLX models (tests/engine/mlx/test_mlx_restart.py).

argv: store directory, phase ("1" or "2"), output .npz. For every case in mlx_models.CASES it
runs that phase's calls and writes each call's tokens, log-probabilities and the cache's stats.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_models  # noqa: E402

from snapstore.engine.mlx import PrefixCache  # noqa: E402


def main() -> None:
    root, phase, out = sys.argv[1], sys.argv[2], sys.argv[3]
    calls = mlx_models.CALLS_1 if phase == "1" else mlx_models.CALLS_2
    arrays: dict[str, np.ndarray] = {}
    stats: dict[str, dict[str, int]] = {}
    for case, (arch, dtype, kw, extra) in mlx_models.CASES.items():
        model = mlx_models.build(arch, dtype=dtype)
        with PrefixCache(model, f"{root}/{case}", boundary=mlx_models.BOUNDARY) as pc:
            for name, prompt, prefix, session in calls:
                res = list(pc.generate_step(mx.array(prompt), cache_prefix=[*prefix, *extra], session=session,
                                            max_tokens=6, **kw))
                arrays[f"{case}.{name}.tokens"] = np.array([t for t, _ in res], np.int64)
                arrays[f"{case}.{name}.logprobs"] = np.stack([np.array(lp.astype(mx.float32)) for _, lp in res])
                st = pc.stats().to_dict()
                st.pop("store")
                stats[f"{case}.{name}"] = st
    target, draft = mlx_models.draft_pair()
    with PrefixCache(target, f"{root}/draft", boundary=mlx_models.BOUNDARY) as pc:
        for name, prompt, prefix, speculative in (mlx_models.SPEC_CALLS_1 if phase == "1" else mlx_models.SPEC_CALLS_2):
            if not speculative:
                list(pc.generate_step(mx.array(prompt), cache_prefix=prefix, max_tokens=2,
                                      prefill_step_size=mlx_models.SPEC_KW["prefill_step_size"]))
                continue
            spec = list(pc.speculative_generate_step(mx.array(prompt), draft, cache_prefix=prefix, max_tokens=8,
                                                     **mlx_models.SPEC_KW))
            arrays[f"draft.{name}.tokens"] = np.array([[t, f] for t, _, f in spec], np.int64)
            arrays[f"draft.{name}.logprobs"] = np.stack([np.array(lp) for _, lp, _ in spec])
            st = pc.stats().to_dict()
            st.pop("store")
            stats[f"draft.{name}"] = st
        # which stored snapshots hold the draft's cache (A's, saved with the draft; B's, saved without)
        st_draft = next(s for s in pc._stores.values() if s.draft is not None)
        for name, prompt in (("a", mlx_models.PROMPT_A), ("b", mlx_models.PROMPT_B)):
            store = st_draft.store("p")
            m = store.match(prompt[:-1])
            stats[f"draft.components.{name}"] = sorted(store.describe(m).components) if m is not None else None
    np.savez(out, stats=np.array(json.dumps(stats)), **arrays)


if __name__ == "__main__":
    main()
