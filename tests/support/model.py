"""The identity and the small layout most tests use: every kind of part (a fixed part, a row
stream, a row stream of the ``draft`` component), a few hundred bytes a token."""

from __future__ import annotations

import snapstore as ss

IDENT = ss.Identity(build="test-1.0+abc", pack="sha256:0123", kv="f16", mtp=True, extra={"flash_attn": "1"})
LAYOUT = ss.Layout(
    fixed={"rec.state": ss.Fixed("float32", (3, 5))},
    rows={"attn.kv": ss.Rows("float16", (2, 4, 8)), "mtp.kv": ss.Rows("float16", (2, 8), component="draft")},
)
