"""``ProbeTrace`` (the identity probe taken out of what llama-proxy serves) on llama-server's page formats.

The real-server check is tests/servers/test_llamacpp_invisible.py; these pin the arithmetic and its
guards on pages written as llama-server writes them (a C++ stream's 6 significant digits).
"""

from __future__ import annotations

import json
from typing import Any

from snapstore.engine.llamacpp._trace import ProbeTrace


def page(prompt: int, secs: float, decodes: int, busy: float, tmax: int) -> str:
    return ("# HELP llamacpp:prompt_tokens_total x\n# TYPE llamacpp:prompt_tokens_total counter\n"
            f"llamacpp:prompt_tokens_total {prompt}\nllamacpp:prompt_seconds_total {secs:g}\n"
            f"llamacpp:n_decode_total {decodes}\nllamacpp:n_tokens_max {tmax}\n"
            f"llamacpp:n_busy_slots_per_decode {busy:g}\nllamacpp:requests_processing 0\n")


class Server:
    """What ProbeTrace reads of llama-server: its pages in turn."""

    def __init__(self, pages: list[str], slots: list[Any]) -> None:
        self.pages, self.slot_pages = pages, slots

    def get_text(self, path: str, what: str = "") -> str:
        return self.pages.pop(0)

    def get_any(self, path: str, what: str = "") -> Any:
        return self.slot_pages.pop(0)


def traced(before: str, after: str, entry: dict[str, Any], probed: dict[str, Any], process: str = "p1"
           ) -> ProbeTrace:
    t = ProbeTrace()
    with t.around(Server([before, after], [[entry], [probed]]), 0, process):  # type: ignore[arg-type]
        pass
    return t


def test_counters_come_back_without_the_probe_and_in_the_servers_format():
    t = traced(page(100, 0.5, 10, 2.0, 40), page(162, 0.501234, 12, 1.75, 40), {"id": 0}, {"id": 0, "id_task": 7})
    later = page(172, 0.601234, 14, 1.5, 300)
    out = t.metrics(later)
    assert "llamacpp:prompt_tokens_total 110\n" in out and "llamacpp:n_decode_total 12\n" in out
    assert "llamacpp:prompt_seconds_total 0.6\n" in out and "llamacpp:n_tokens_max 300\n" in out
    # busy slots: 2.0*10 before; the probe added 1.75*12 - 20 = 1; now 1.5*14 = 21, so (21 - 1) / 12
    busy = next(ln for ln in out.splitlines() if ln.startswith("llamacpp:n_busy_slots_per_decode"))
    assert busy == f"llamacpp:n_busy_slots_per_decode {20 / 12:g}"
    assert out.startswith("# HELP llamacpp:prompt_tokens_total x\n") and out.endswith("requests_processing 0\n")


def test_n_tokens_max_shows_the_value_before_the_probe_until_a_request_passes_it():
    t = traced(page(1, 0.0, 1, 1, 10), page(65, 0.0, 3, 1, 32), {"id": 0}, {"id": 0, "id_task": 3})
    assert "llamacpp:n_tokens_max 10\n" in t.metrics(page(65, 0.0, 3, 1, 32))
    assert "llamacpp:n_tokens_max 33\n" in t.metrics(page(99, 0.0, 4, 1, 33))


def test_a_restarted_server_is_shown_as_it_reports():
    t = traced(page(100, 0.5, 10, 1, 40), page(164, 0.6, 12, 1, 40), {"id": 0}, {"id": 0, "id_task": 7})
    fresh = page(20, 0.1, 2, 1, 20)  # counters lower than just after the probe: another process
    assert t.metrics(fresh) == fresh


def test_the_probe_slot_is_shown_as_before_until_it_runs_another_task():
    entry = {"id": 0, "is_processing": False, "id_task": 2, "n_prompt_tokens": 218}
    t = traced(page(1, 0, 1, 1, 1), page(65, 0, 3, 1, 32), entry, {"id": 0, "is_processing": False, "id_task": 9})
    other = {"id": 1, "is_processing": False}
    probed = json.dumps([{"id": 0, "is_processing": False, "id_task": 9, "n_prompt_tokens": 32}, other]).encode()
    assert json.loads(t.slots(probed)) == [entry, other]
    moved_on = json.dumps([{"id": 0, "is_processing": True, "id_task": 12}, other]).encode()
    assert t.slots(moved_on) == moved_on


def test_a_second_probe_in_the_same_slot_keeps_the_entry_from_before_the_first():
    entry = {"id": 0, "id_task": 2}
    t = ProbeTrace()
    for before, after in ((entry, {"id": 0, "id_task": 9}), ({"id": 0, "id_task": 9}, {"id": 0, "id_task": 15})):
        with t.around(Server([page(1, 0, 1, 1, 1), page(1, 0, 1, 1, 1)], [[before], [after]]), 0, "p"):  # type: ignore[arg-type]
            pass
    assert json.loads(t.slots(json.dumps([{"id": 0, "id_task": 15}]).encode())) == [entry]
