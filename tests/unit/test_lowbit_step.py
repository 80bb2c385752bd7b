"""components/lowbit_step.py + ops/adamw_lowbit_triton.py: the fused AdamW8bit step against torchao's own step
function (run eagerly), under Triton's CPU interpreter; the [optimizer] implementation choices. The FP8 format is
checked on the GPU (tests/gpu/test_lowbit_step_cuda.py): the interpreter's FP32 -> E4M3 cast mis-rounds values that
round up to the next power of two (127.6 -> 64 with Triton 3.6), which the hardware cast does not."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from torchtitan_glm.components.optimizer import build_optimizer
from torchtitan_glm.config import ConfigError, OptimizerConfig

_SCRIPT = r"""
import os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torchao.optim import AdamW8bit
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit
from torchtitan_glm.components.lowbit_step import fused_lowbit_step

dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
# quantised (>= 4096 values, a multiple of 256), plain: too small, and >= 4096 values but not a multiple of 256
SHAPES = [(64, 128), (48, 256), (4100,), (100,), (3, 7)]


def make(seed, dtensor):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for s in SHAPES:
        t = torch.randn(s, generator=g) * 0.1
        ps.append(nn_param(distribute_tensor(t, mesh, [Shard(0)]) if dtensor else t))
    return ps


def nn_param(t):
    return torch.nn.Parameter(t)


def reference_step(opt):  # torchao's AdamW step, its function called eagerly (its own step compiles it)
    for grp in opt.param_groups:
        b1, b2 = grp["betas"]
        for p in grp["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"], st["exp_avg_sq"] = opt._new_buffer(p, True), opt._new_buffer(p, False)
            st["step"] += 1
            single_param_adam(p.detach(), p.grad, st["step"], st["exp_avg"], st["exp_avg_sq"], None, grp["lr"],
                              b1, b2, grp["weight_decay"], grp["eps"], True, False)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


for betas, wd, dtensor in (((0.9, 0.95), 0.1, False), ((0.3, 0.4), 0.0, False), ((0.9, 0.999), 0.05, True)):
    runs = []
    for fused in (True, False):
        ps = make(0, dtensor and fused)
        opt = AdamW8bit([{"params": ps[:3], "weight_decay": wd}, {"params": ps[3:], "weight_decay": 0.0}],
                        lr=3e-3, betas=betas)
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            opt.param_groups[0]["lr"].fill_(3e-3 * (step + 1) / 4)  # the schedule's way of setting torchao's lr
            for p in ps:
                grad = torch.randn(p.shape, generator=g) * 0.01
                p.grad = distribute_tensor(grad, mesh, [Shard(0)]) if dtensor and fused else grad
            (fused_lowbit_step if fused else reference_step)(opt)
        runs.append((ps, opt))
    (fp, fo), (rp, ro) = runs
    for a, b, shape in zip(fp, rp, SHAPES):
        a, b = local(a.detach()), b.detach()
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (betas, shape, (a - b).abs().max())
        assert not torch.equal(b, make(0, False)[SHAPES.index(shape)]), shape  # the step moved it
        sa, sb = fo.state[fp[SHAPES.index(shape)]], ro.state[rp[SHAPES.index(shape)]]
        assert float(sa["step"]) == float(sb["step"]) == 4.0
        for k in ("exp_avg", "exp_avg_sq"):
            x, y = local(sa[k]), local(sb[k])
            quantised = shape in ((64, 128), (48, 256))
            assert isinstance(x, OptimState8bit) == isinstance(y, OptimState8bit) == quantised, (shape, k)
            if quantised:
                diff = (x.codes.int() - y.codes.int()).abs()
                # codes differ only where FP32 rounding order puts a value on the other side of a midpoint
                assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, (shape, k, diff.max(), (diff > 0).sum())
                assert torch.allclose(x.scale, y.scale, rtol=1e-6, atol=0), (shape, k)
                assert torch.equal(x.qmap, y.qmap)
            else:
                assert x.dtype == torch.float32 and (x - y).abs().max() <= 1e-6 * y.abs().max(), (
                    shape, k, type(x), (x - y).abs().max(), y.abs().max())
    print("case", betas, wd, "dtensor" if dtensor else "plain", "ok")
dist.destroy_process_group()
print("FUSED_LOWBIT_OK")
"""


def test_fused_adamw8bit_matches_torchaos_step_under_the_interpreter():
    """Four steps with a changing lr, both lerp branches (beta 0.9 and 0.3), decay and no-decay groups, quantised
    and plain states, DTensor parameters: parameters, codes, scales and plain moments as torchao's step gives."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "FUSED_LOWBIT_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
def test_low_bit_implementation_choice(name):
    """On CPU "auto" is torchao's compiled step and "fused" (a Triton kernel over CUDA parameters) is refused,
    naming the key; torch AdamW's implementations are refused for the low-bit ones and the other way round."""
    model = nn.Linear(64, 64)
    assert build_optimizer(model=model, cfg=OptimizerConfig(name=name)).implementation == "compiled"
    assert build_optimizer(model=model, cfg=OptimizerConfig(name=name, implementation="compiled")
                           ).implementation == "compiled"
    with pytest.raises(ConfigError) as e:
        build_optimizer(model=model, cfg=OptimizerConfig(name=name, implementation="fused"))
    assert e.value.key == "optimizer.implementation" and "CUDA" in str(e.value)
    for impl in ("foreach", "for-loop"):
        with pytest.raises(ConfigError) as e:
            OptimizerConfig(name=name, implementation=impl).validate()
        assert e.value.key == "optimizer.implementation" and "compiled" in str(e.value)
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(name="AdamW", implementation="compiled").validate()
    assert e.value.key == "optimizer.implementation"
