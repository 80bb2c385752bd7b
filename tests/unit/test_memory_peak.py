"""components/memory_peak.py: the live blocks at a trace's peak (or out-of-memory), summed by the allocating line."""

from __future__ import annotations

from torchtitan_glm.components.memory_peak import breakdown, live_at_peak, reserved_by_stream


def _frames(name: str, line: int) -> list[dict]:
    return [{"filename": "/venv/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": f"/repo/torchtitan_glm/models/glm5/{name}.py", "line": line, "name": "forward"}]


def _alloc(addr: int, size: int, name: str, line: int) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": _frames(name, line)}


def _free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


def test_the_peak_is_the_highest_point_not_the_end():
    trace = [_alloc(1, 100, "dsa", 10), _alloc(2, 50, "moe", 20), _free(1, 100), _alloc(3, 70, "moe", 20),
             _free(3, 70), _free(2, 50)]
    peak, rows = live_at_peak({"device_traces": [trace]})
    assert peak == 150  # blocks 1 + 2 before block 1 is freed; later at most 2 + 3 = 120
    assert rows == [(100, 1, "torchtitan_glm/models/glm5/dsa.py:10 forward"),
                    (50, 1, "torchtitan_glm/models/glm5/moe.py:20 forward")]


def test_an_out_of_memory_is_the_peak_with_the_failed_request():
    trace = [_alloc(1, 100, "dsa", 10), _free(1, 100), _alloc(2, 60, "moe", 20), _alloc(3, 30, "moe", 20),
             {"action": "oom", "addr": 0, "size": 500, "frames": []}]
    peak, rows = live_at_peak({"device_traces": [trace]})
    assert peak == 590
    assert rows == [(500, 1, "(the failed request)"), (90, 2, "torchtitan_glm/models/glm5/moe.py:20 forward")]


def test_blocks_outside_the_project_are_named_by_their_innermost_frame():
    trace = [{"action": "alloc", "addr": 1, "size": 8, "frames": _frames("x", 1)[:1]}]
    assert live_at_peak({"device_traces": [trace]})[1] == [(8, 1, "functional.py:1 linear")]


def test_reserved_memory_is_summed_per_stream_pool():
    gib = 2**30
    segments = [{"device": 0, "stream": 0, "total_size": 8 * gib, "allocated_size": 6 * gib},
                {"device": 0, "stream": 0x5A, "total_size": 3 * gib, "allocated_size": 0},
                {"device": 0, "stream": 0, "total_size": 2 * gib, "allocated_size": 2 * gib},
                {"device": 1, "stream": 0, "total_size": 99 * gib, "allocated_size": 0}]  # another device
    assert reserved_by_stream({"segments": segments}) == [(0, 10 * gib, 8 * gib, 2), (0x5A, 3 * gib, 0, 1)]
    table = breakdown({"device_traces": [[_alloc(1, gib, "dsa", 10)]], "segments": segments}, title="t")
    assert "| 0x5a | 3.000 | 0.000 | 3.000 | 1 |" in table and "| 0 | 10.000 | 8.000 | 2.000 | 2 |" in table
