"""lr_scheduler.py: warmup shape, cosine/linear/WSD decay, the floor, and checkpointable state."""

import math

import pytest
import torch

from torchtitan_glm.components.lr_scheduler import build_lr_scheduler, lr_factor
from torchtitan_glm.config import LRSchedulerConfig


def factors(total, **kw):
    cfg = dict(warmup_steps=10, decay_type="cosine", decay_ratio=0.2, min_lr_factor=0.1) | kw
    return [lr_factor(s, total_steps=total, **cfg) for s in range(total + 5)]


def test_warmup_is_linear_from_near_zero():
    f = factors(100, warmup_steps=10)
    assert f[:10] == pytest.approx([(s + 1) / 11 for s in range(10)])
    assert 0 < f[0] < 0.1
    assert all(b > a for a, b in zip(f[:10], f[1:11]))


def test_cosine_shape_and_end_value():
    total, w, floor = 100, 10, 0.1
    f = factors(total, warmup_steps=w, min_lr_factor=floor)
    assert f[w] > 0.999  # decay starts at the peak
    assert all(b <= a for a, b in zip(f[w:total], f[w + 1:total]))
    assert f[total - 1] == pytest.approx(floor)  # last training step lands on the floor
    mid = w + (total - w) // 2 - 1  # progress 0.5
    assert f[mid] == pytest.approx(floor + (1 - floor) * 0.5, abs=1e-9)
    assert f[total:] == [floor] * 5  # stays floored past the end
    quarter = w + (total - w) // 4 - 1
    p = (quarter - w + 1) / (total - w)
    assert f[quarter] == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def test_linear_decay():
    f = factors(50, warmup_steps=0, decay_type="linear", min_lr_factor=0.0)
    diffs = [a - b for a, b in zip(f[:50], f[1:50])]
    assert diffs == pytest.approx([1 / 50] * 49)
    assert f[49] == pytest.approx(0.0)


def test_wsd_plateau_then_decay():
    total, w, ratio, floor = 100, 5, 0.2, 0.05
    f = factors(total, warmup_steps=w, decay_type="wsd", decay_ratio=ratio, min_lr_factor=floor)
    decay_start = total - round(ratio * total)
    assert f[w:decay_start] == [1.0] * (decay_start - w)  # stable phase
    tail = f[decay_start:total]
    assert len(tail) == 20 and all(b < a for a, b in zip(tail, tail[1:]))
    assert tail[-1] == pytest.approx(floor) and tail[0] < 1.0
    assert [a - b for a, b in zip(tail, tail[1:])] == pytest.approx([(1 - floor) / 20] * 19)


def test_unknown_decay_type_raises():
    with pytest.raises(ValueError, match="decay_type"):
        lr_factor(20, warmup_steps=1, total_steps=30, decay_type="exp", decay_ratio=0.1, min_lr_factor=0.0)


def _run(steps, sched_cfg, total, state=None, start=0):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = build_lr_scheduler(optimizer=opt, cfg=sched_cfg, total_steps=total)
    if state is not None:
        sched.load_state_dict(state)
    lrs = []
    for _ in range(start, steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs, sched.state_dict()


def test_scheduler_follows_lr_factor_and_resumes():
    cfg = LRSchedulerConfig(warmup_steps=3, decay_type="cosine", decay_ratio=0.1, min_lr_factor=0.2)
    total = 12
    lrs, _ = _run(total, cfg, total)
    expect = [2.0 * lr_factor(s, warmup_steps=3, total_steps=total, decay_type="cosine", decay_ratio=0.1,
                              min_lr_factor=0.2) for s in range(total)]
    assert lrs == pytest.approx(expect)
    first, state = _run(5, cfg, total)
    rest, _ = _run(total, cfg, total, state=state, start=5)
    assert first + rest == pytest.approx(lrs)
    assert state["last_epoch"] == 5
