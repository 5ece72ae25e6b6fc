"""snapstore.testing pointed at an engine: the torch adapter with the token axis inside the tensor.

The harness is what docs/engine.md section 9 shows an engine author writing. A second harness that
corrupts one row on save proves the machine fails when an integration is wrong.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, settings
from support.profile import lighter_in_dev

import snapstore as ss
from snapstore.testing import NumpyEngine, StoreStateMachine, Workload

torch = pytest.importorskip("torch")
from snapstore.engine import TorchAdapter, torch_dtype  # noqa: E402

LAYOUT = ss.Layout(fixed={"ssm": ss.Fixed("float32", (4, 8))},
                   rows={"kv": ss.Rows("bfloat16", (2, 16)), "mtp": ss.Rows("float16", (4,), component="draft")})
TOKEN_DIMS = {"kv": 1, "mtp": 0}  # kv lives as [2, T, 16] in the engine: the adapter moves the token axis


def _engine_tensor(name: str, raw: np.ndarray) -> Any:
    """Raw bytes of a part as the engine holds it: its dtype, its own axis order (a strided view)."""
    spec = LAYOUT.parts[name]
    t = torch.from_numpy(raw.copy()).view(torch_dtype(spec.dtype))
    if isinstance(spec, ss.Fixed):
        return t.reshape(spec.shape)
    return t.reshape(-1, *spec.row_shape).movedim(0, TOKEN_DIMS[name])


class TorchEngine(NumpyEngine):
    """save/restore through TorchAdapter with engine-shaped tensors."""

    def save(self, store: ss.Store, tokens: np.ndarray, state: Any, **kw: Any) -> ss.SaveResult:
        parts = {k: _engine_tensor(k, v) for k, v in state.items()}
        return TorchAdapter(store, token_dims=TOKEN_DIMS).save(tokens, parts, **kw)

    def restore(self, store: ss.Store, ref: Any,
                session: str | None = None) -> tuple[ss.RestoreResult, dict[str, bytes]]:
        into = {k: _engine_tensor(k, np.zeros(s.nbytes if isinstance(s, ss.Fixed) else s.row_bytes * self.max_rows,
                                              np.uint8)) for k, s in LAYOUT.parts.items()}
        res = TorchAdapter(store, token_dims=TOKEN_DIMS).restore(ref, into, session=session)
        out = {}
        for k, s in LAYOUT.parts.items():
            if s.component in res.missing_components:
                continue
            t = into[k] if isinstance(s, ss.Fixed) else into[k].movedim(TOKEN_DIMS[k], 0)[: res.rows[k]]
            out[k] = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return res, out


class FlipsARow(TorchEngine):
    """A broken integration: row 150 of kv is spoiled on its way in."""

    def save(self, store: ss.Store, tokens: np.ndarray, state: Any, **kw: Any) -> ss.SaveResult:
        kv = state["kv"].copy()
        kv[150 * LAYOUT.rows["kv"].row_bytes] ^= 1
        return super().save(store, tokens, {**state, "kv": kv}, **kw)


WORK = Workload(LAYOUT, conversations=3, max_tokens=300, shared=80)
# the dev profile (make test) runs 3 x 15 steps, not its 5 x 20; ci and long run their own counts
TestTorchEngine = lighter_in_dev(StoreStateMachine.for_engine(TorchEngine(LAYOUT), workload=WORK).TestCase, 3, 15)


def test_machine_catches_a_broken_integration() -> None:
    broken = StoreStateMachine.for_engine(FlipsARow(LAYOUT), workload=WORK).TestCase
    broken.settings = settings(settings.default, phases=[Phase.generate], max_examples=50)  # no shrinking
    # caught either way: a restore that is not byte-exact, or the store's own check of the rows a
    # delta vouches for (check_rows, on in tests), when a walk saves over the flipped row first
    with pytest.raises((AssertionError, ss.InvalidInputError), match="byte-exact|check_rows"):
        broken("runTest").runTest()


class DropsTheNamespace(TorchEngine):
    """A broken integration: a tenant's state is saved in the default namespace (the kwarg is lost)."""

    def save(self, store: ss.Store, tokens: np.ndarray, state: Any, **kw: Any) -> ss.SaveResult:
        kw.pop("namespace", None)
        return super().save(store, tokens, state, **kw)


def test_machine_catches_an_integration_that_loses_the_namespace() -> None:
    """The machine's namespaces (issue 46): a save that lands in the wrong namespace is found. The
    machine moves time.time forward (TTLs, names' ttl_s); a failing run leaves the clock as it was."""
    real = time.time
    broken = StoreStateMachine.for_engine(DropsTheNamespace(LAYOUT), workload=WORK).TestCase
    broken.settings = settings(settings.default, phases=[Phase.generate], max_examples=50)  # no shrinking
    with pytest.raises((AssertionError, ss.IdentityError)) as err:  # a check fails, or a call for its namespace
        broken("runTest").runTest()
    assert isinstance(err.value, ss.IdentityError) or "namespace" in str(err.value) \
        or "does not match its own tokens" in str(err.value)
    assert time.time is real

