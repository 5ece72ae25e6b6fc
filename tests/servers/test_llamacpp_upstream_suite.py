"""llama.cpp's own server test suite, directly (mode A) and through ``snapstore llama-proxy`` (mode B).

The runner lives outside the project, in ``../shared/llama-server-tests`` (CI puts a copy of shared/
beside the clone; ``SNAPSTORE_LLT_DIR`` names another place). Its ``run.sh setup`` takes the suite
from the llama.cpp that llama-cpp-python's source distribution vendors (downloaded from the package
registry into a work directory outside the repository): nothing of llama.cpp's code is kept here.
It runs both ways — as the suite starts its servers (mostly ``--no-slots``) and with ``LLT_SLOTS_ON=1``
(``/slots`` on, where the proxy's restores and saves run) — and asserts that mode B passes every test
mode A passes. Each mode of the selection takes 2-6 minutes on two quiet cores (mode B pays about
2 s per server start for the proxy's own start; 7-15 minutes at load 10), at most
``SNAPSTORE_LLT_TIMEOUT`` (720 s) per mode, a mode cut short failing the test; ``SNAPSTORE_LLT_TESTS``
may name a smaller selection file (the runner's TESTS_FILE) and ``SNAPSTORE_LLT_WORK`` a work
directory kept between runs (the sdist and the suite's venv fetched once). Skipped, with the reason,
where the runner or the registry is not available.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real servers (tests/README.md: the slow tier)

pytest.importorskip("xllamacpp")

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(os.environ.get("SNAPSTORE_LLT_DIR") or ROOT.parent / "shared" / "llama-server-tests")


def _outcomes(xml: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a junit file."""
    out = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        state = "passed"
        for k in ("failure", "error", "skipped"):
            if tc.find(k) is not None:
                state = k
        out[name] = state
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (RUNNER / "run.sh").is_file():
        pytest.skip(f"llama.cpp's server test runner is not at {RUNNER} (CI puts shared/ beside the clone; "
                    "set SNAPSTORE_LLT_DIR to another copy)")
    cache = os.environ.get("SNAPSTORE_LLT_WORK")  # a work dir kept between runs (the sdist, the suite's venv)
    return Path(cache).resolve() if cache else tmp_path_factory.mktemp("llt")


def _setup(work: Path, slots_on: bool, env: dict[str, str]) -> None:
    """The suite extracted as this variant wants it (one work dir: the sdist and the suite's venv are
    fetched once; ``LLT_SLOTS_ON`` only changes the extracted ``utils.py``)."""
    marker = work / "variant"
    want = "slots" if slots_on else "default"
    if marker.is_file() and marker.read_text() == want and (work / "testvenv").is_dir():
        return
    setup = subprocess.run(["bash", str(RUNNER / "run.sh"), "setup"], env=env, capture_output=True, text=True,
                           timeout=1200)
    if setup.returncode != 0:
        pytest.skip(f"the runner's setup failed (package registry unreachable?): {setup.stderr[-500:]}")
    marker.write_text(want)


def _run(work: Path, mode: str, slots_on: bool, only: list[str] | None = None) -> dict[str, str]:
    """Run the selection in ``mode``; ``only``: just these test ids (a re-run)."""
    tag = "slots" if slots_on else "default"
    env = {**os.environ, "LLT_WORK": str(work), "LLT_PYTHON": sys.executable, "LLT_PIP_PYTHON": sys.executable,
           "LLT_TAG": tag,
           "LLT_SLOTS_ON": "1" if slots_on else "0", "RUN_TIMEOUT": os.environ.get("SNAPSTORE_LLT_TIMEOUT", "720")}
    env.pop("PIP_PYTHON", None)
    if os.environ.get("SNAPSTORE_LLT_TESTS"):
        env["TESTS_FILE"] = os.environ["SNAPSTORE_LLT_TESTS"]
    if only is not None:  # junit's "unit.test_x::name" as a pytest node id "unit/test_x.py::name"
        sel = work / "rerun.txt"
        sel.write_text("".join(t.split("::", 1)[0].replace(".", "/") + ".py::" + t.split("::", 1)[1] + "\n"
                               for t in only))
        env["TESTS_FILE"] = str(sel)
    _setup(work, slots_on, env)
    subprocess.run(["bash", str(RUNNER / "run.sh"), mode], env=env, check=True, timeout=1500, capture_output=True)
    xml = work / "logs" / f"junit-{mode}-{tag}.xml"
    assert xml.is_file(), (f"mode {mode} wrote no results ({xml}): cut short after {env['RUN_TIMEOUT']} s (a loaded "
                           "machine: raise SNAPSTORE_LLT_TIMEOUT) or the runner failed (its log is beside it)")
    return _outcomes(xml)


@pytest.mark.parametrize("slots_on", [False, True], ids=["as-the-suite-starts-servers", "slots-on"])
def test_the_proxy_passes_every_upstream_server_test_a_direct_server_passes(work: Path, slots_on: bool) -> None:
    a = _run(work, "A", slots_on)
    b = _run(work, "B", slots_on)
    passed_a = {t for t, s in a.items() if s == "passed"}
    assert passed_a, "mode A passed nothing: the runner or the stand-in is broken"
    lost = sorted(t for t in passed_a if b.get(t) != "passed")
    # llama-server itself is not steady on every test: its own /cors-proxy at times closes the
    # connection with no response (seen directly, in mode A, about half the time on these
    # machines). A test the proxy loses is run through the proxy again, three times at most; one
    # that passes then is no loss the proxy causes. One that never does is run directly three
    # times: if it fails directly too, the server is what is unsteady, and it is reported, not lost.
    for _ in range(3):
        if not lost:
            break
        again = _run(work, "B", slots_on, only=lost)
        lost = [t for t in lost if again.get(t) != "passed"]
    unsteady: set[str] = set()
    for _ in range(3 if lost else 0):
        direct = _run(work, "A", slots_on, only=lost)
        unsteady |= {t for t in lost if direct.get(t) != "passed"}
    if unsteady:
        warnings.warn(f"llama-server fails these directly too, on a re-run: {sorted(unsteady)}", stacklevel=1)
    lost = [t for t in lost if t not in unsteady]
    assert not lost, f"{len(lost)} of llama.cpp's server tests pass directly but not through the proxy: {lost}"
