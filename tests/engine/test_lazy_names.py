"""The integrations' names load on first use (engine/_lazy.py): importing a package imports no
runtime; without the runtime, using a name raises the package's missing-runtime error (an
ImportError and a SnapstoreError saying what to install), and that error's class itself can be
imported to catch it (was: importing it raised it). Each case in a child process where the runtime
is made absent (``sys.modules[name] = None``), so it holds whether or not the runtime is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = """
import sys
for name in sys.argv[2].split(","):
    sys.modules[name] = None
import importlib
import snapstore
pkg = importlib.import_module(sys.argv[1])
runtime = [m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "torch") and sys.modules[m] is not None]
assert not runtime, runtime
# the missing-runtime error's class, where the package exports it: importable without the runtime
error = getattr(pkg, sys.argv[3]) if sys.argv[3] else ImportError
for attempt in range(2):  # the same class the second time too (a failed import defines a new one)
    try:
        getattr(pkg, sys.argv[4])
    except error as e:
        assert isinstance(e, ImportError) and isinstance(e, snapstore.SnapstoreError), type(e).__mro__
        assert "pip install" in str(e), e
        print("refused:", e)
    else:
        raise SystemExit("no error")
"""


@pytest.mark.parametrize(("package", "absent", "error", "name"), [
    ("snapstore.engine.mlx", "mlx,mlx_lm", "MlxMissingError", "PrefixCache"),
    ("snapstore.engine.mlx", "mlx_lm", "MlxMissingError", "export_prompt_cache"),
    ("snapstore.engine.torch", "torch", "", "TensorSink"),  # TorchMissingError is no public name
])
def test_a_missing_runtime_is_named_and_its_error_can_be_caught(package: str, absent: str, error: str,
                                                                name: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", _CHILD, package, absent, error, name], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0 and "refused:" in r.stdout, r.stderr[-2000:]
