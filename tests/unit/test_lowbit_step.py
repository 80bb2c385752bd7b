"""ops/adamw_lowbit.py + components/lowbit_step.py, the "fused" low-bit AdamW step: its torch reference against
torchao's own step function (run eagerly) for both state formats and DTensor parameters; its Triton kernel against
the reference under Triton's CPU interpreter; the [optimizer] implementation choices. The kernel's FP8 format is
checked on the GPU only (tests/gpu/test_lowbit_step_cuda.py): the interpreter's FP32 -> E4M3 cast mis-rounds values
that round up to the next power of two (127.6 -> 64 with Triton 3.6), which the hardware cast does not."""

import os

import pytest
import torch
from torch import nn

from tests.interpret import ROOT, run_interpreted
from torchtitan_glm.components.lowbit_step import fused_lowbit_step
from torchtitan_glm.components.optimizer import build_optimizer
from torchtitan_glm.config import ConfigError, OptimizerConfig

# quantised (>= 4096 values, a multiple of 256), and plain: too small, or >= 4096 values but not a multiple of 256
SHAPES = [(64, 128), (48, 256), (4100,), (100,), (3, 7)]
QUANTISED = {(64, 128), (48, 256)}


def _params(seed: int, wrap=lambda t: t) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(wrap(torch.randn(s, generator=g) * 0.1)) for s in SHAPES]


def _torchao_step(opt) -> None:
    """torchao's AdamW step, its per-parameter function called eagerly (torchao's own step compiles it)."""
    from torchao.optim.adam import single_param_adam

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


def _train(cls, step, *, betas, wd, wrap=lambda t: t):
    ps = _params(0, wrap)
    opt = cls([{"params": ps[:3], "weight_decay": wd}, {"params": ps[3:], "weight_decay": 0.0}], lr=3e-3,
              betas=betas)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        opt.param_groups[0]["lr"].fill_(3e-3 * (i + 1) / 4)  # the schedule's way of setting torchao's tensor lr
        for p in ps:
            p.grad = wrap(torch.randn(p.shape, generator=g) * 0.01)
        step(opt)
    return ps, opt


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _assert_same_training(fused, reference, *, fp8: bool) -> None:
    (fp, fo), (rp, ro) = fused, reference
    start = _params(0)
    for a, b, s0, shape in zip(fp, rp, start, SHAPES):
        a, b = _local(a.detach()), b.detach()
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (shape, (a - b).abs().max())
        assert not torch.equal(b, s0), shape  # the steps moved it
        sa, sb = fo.state[fp[SHAPES.index(shape)]], ro.state[rp[SHAPES.index(shape)]]
        assert float(sa["step"]) == float(sb["step"]) == 4.0
        for k in ("exp_avg", "exp_avg_sq"):
            x, y = _local(sa[k]), _local(sb[k])
            assert hasattr(x, "codes") == hasattr(y, "codes") == (shape in QUANTISED), (shape, k)
            if shape in QUANTISED:
                # codes one apart (adjacent map entries; adjacent E4M3 values of one sign) where FP32 rounding order
                # puts a value on the other side of a midpoint
                diff = (x.codes.view(torch.uint8).int() - y.codes.view(torch.uint8).int()).abs()
                assert diff.max() <= 1 and (diff > 0).float().mean() < 2e-3, (shape, k, (diff > 0).sum())
                assert torch.allclose(x.scale, y.scale, rtol=1e-6, atol=0), (shape, k)
            else:
                assert x.dtype == torch.float32 and (x - y).abs().max() <= 1e-6 * y.abs().max(), (shape, k)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
@pytest.mark.parametrize("betas,wd", [((0.9, 0.95), 0.1), ((0.3, 0.4), 0.0)])
def test_reference_step_matches_torchaos(name, betas, wd):
    """Four steps with a changing lr, both lerp branches (beta 0.9 and 0.3), decay and no-decay groups, quantised
    and plain states: parameters, codes, scales and plain moments as torchao's own step function gives them."""
    import torchao.optim

    cls = getattr(torchao.optim, name)
    _assert_same_training(_train(cls, fused_lowbit_step, betas=betas, wd=wd),
                          _train(cls, _torchao_step, betas=betas, wd=wd), fp8=name == "AdamWFp8")


def test_reference_step_on_dtensor_parameters(world_of_one):
    """FSDP2's parameters are DTensors (their states DTensors over torchao's subclasses): stepped on the local
    shards, the same as plain tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torchao.optim import AdamW8bit

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    fused = _train(AdamW8bit, fused_lowbit_step, betas=(0.9, 0.95), wd=0.1,
                   wrap=lambda t: distribute_tensor(t, mesh, [Shard(0)]))
    assert isinstance(fused[0][0], DTensor) and isinstance(fused[1].state[fused[0][0]]["exp_avg"], DTensor)
    _assert_same_training(fused, _train(AdamW8bit, _torchao_step, betas=(0.9, 0.95), wd=0.1), fp8=False)


_INTERPRET = r"""
import torch
from torchao.optim.subclass_8bit import OptimState8bit
from torchtitan_glm.ops.adamw_lowbit import DYNAMIC8, PLAIN, state_parts, adamw_lowbit_step_
from torchtitan_glm.ops.adamw_lowbit_triton import CODE_SEARCHES, adamw_lowbit_kernel_

def snap(state):  # torchao's state subclasses have no deepcopy
    return [state.codes.clone(), state.scale.clone()] if hasattr(state, "codes") else [state.clone()]


g = torch.Generator().manual_seed(0)
for fmt, numel, betas in ((DYNAMIC8, 8192, (0.9, 0.95)), (DYNAMIC8, 2048, (0.3, 0.4)), (PLAIN, 4100, (0.9, 0.95))):
    runs = []
    for use_kernel in (True, False):
        g.manual_seed(numel)
        p = torch.randn(numel, generator=g) * 0.1
        states = [OptimState8bit.zeros((numel,), signed, 256) if fmt == DYNAMIC8 else torch.zeros(numel)
                  for signed in (True, False)]
        for step in range(1, 5):
            grad = torch.randn(numel, generator=g) * 0.01
            sc = dict(lr=1e-3 * step, lr_wd=1e-4 * step, beta1=betas[0], beta2=betas[1], eps=1e-8)
            count = torch.tensor(float(min(step, 3)))
            skip = torch.tensor(float(step == 4))  # the 4th step is skipped: nothing may change
            if step == 4:
                before = p.clone(), [snap(s) for s in states]
            if use_kernel:  # the 8-bit codes found each way in turn (the binary search in the skipped step)
                adamw_lowbit_kernel_(p, grad, *state_parts(states[0], fmt), *state_parts(states[1], fmt), count, skip,
                                     fmt=fmt, codes=CODE_SEARCHES[step % 4], **sc)
            else:
                adamw_lowbit_step_(p, grad, *states, count, fmt=fmt, found_inf=skip, **sc)
        assert torch.equal(p, before[0]), "a skipped step moved the parameter"
        for now, then in zip(states, before[1]):
            assert all(map(torch.equal, snap(now), then)), "a skipped step changed a moment"
        runs.append((p, states))
    (kp, ks), (rp, rs) = runs
    assert (kp - rp).abs().max() <= 1e-6 * rp.abs().max(), (fmt, (kp - rp).abs().max())
    for x, y in zip(ks, rs):
        if fmt == DYNAMIC8:
            diff = (x.codes.int() - y.codes.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 2e-3, (fmt, (diff > 0).sum())
            assert torch.allclose(x.scale, y.scale, rtol=1e-6, atol=0)
        else:
            assert (x - y).abs().max() <= 1e-6 * y.abs().max()
    print("case", fmt, numel, betas, "ok")
print("TRITON_INTERPRET_OK")
"""


def test_triton_kernel_matches_the_reference_under_the_interpreter():
    """The kernel (AdamW8bit's map, plain states with a ragged tail, both lerp branches) against the custom op's
    torch reference, three steps each, then a step under found_inf that changes nothing, in Triton's CPU
    interpreter. The kernel's bias corrections come from exp2(step log2 beta), the reference's from pow."""
    pytest.importorskip("triton")
    res = run_interpreted("-c", _INTERPRET)
    assert res.returncode == 0 and "TRITON_INTERPRET_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_8bit_codes_found_each_way_equal_the_reference():
    """The kernel's 8-bit codes, found each way, against the reference's searchsorted rule, on
    every entry and midpoint of both maps (and FP32 neighbours), powers of ten and random magnitudes
    (tests/lowbit_codes.py), in Triton's CPU interpreter."""
    pytest.importorskip("triton")
    res = run_interpreted(os.path.join(ROOT, "tests", "lowbit_codes.py"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "'signed: direct != reference': 0" in res.stdout and "'unsigned: checked != reference': 0" in res.stdout


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
def test_low_bit_implementation_choice(name):
    """"fused" builds the project's step, "compiled" torchao's, "auto" the fused one on CPU and CUDA (AdamW's
    "auto" still depends on the device); torch AdamW's implementations are refused for the low-bit ones and
    "compiled" for AdamW, naming the key."""
    from torchtitan_glm.components.optimizer import resolved_implementation

    assert resolved_implementation(OptimizerConfig(name=name), on_cuda=True) == "fused"
    assert resolved_implementation(OptimizerConfig(name=name), on_cuda=False) == "fused"
    assert resolved_implementation(OptimizerConfig(name=name, implementation="compiled"), on_cuda=True) == "compiled"
    assert resolved_implementation(OptimizerConfig(name="AdamW"), on_cuda=True) == "fused"
    assert resolved_implementation(OptimizerConfig(name="AdamW"), on_cuda=False) == "foreach"
    assert resolved_implementation(OptimizerConfig(name=name, implementation="fused"), on_cuda=True) == "fused"
    model = nn.Linear(64, 64)
    for impl, expect in (("auto", "fused"), ("fused", "fused"), ("compiled", "compiled")):
        assert build_optimizer(model=model, cfg=OptimizerConfig(name=name, implementation=impl)
                               ).implementation == expect
    for impl in ("foreach", "for-loop"):
        with pytest.raises(ConfigError) as e:
            OptimizerConfig(name=name, implementation=impl).validate()
        assert e.value.key == "optimizer.implementation" and "compiled" in str(e.value)
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(name="AdamW", implementation="compiled").validate()
    assert e.value.key == "optimizer.implementation" and "torchao's step of AdamW8bit" in str(e.value)
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(name=name, implementation="fussed").validate()
    assert e.value.key == "optimizer.implementation" and "foreach" not in str(e.value)


def test_found_inf_skips_the_fused_step_on_the_device():
    """The fused low-bit step takes the trainer's device-side non-finite skip (components/step_stats.py): under
    found_inf = 1 parameters, codes, scales and step counts stay as they were; under 0 it is the plain step. torchao's
    compiled step has no found_inf, so the trainer reads the flag for it."""
    from torchao.optim import AdamW8bit

    from torchtitan_glm.components.step_stats import optimizer_step, supports_device_skip

    cpu = torch.device("cpu")
    runs = []
    for flag in (None, torch.zeros(())):
        ps = _params(0)
        opt = build_optimizer(model=_Holder(ps), cfg=OptimizerConfig(name="AdamW8bit", lr=1e-3))
        assert supports_device_skip(opt, device=cpu) and not supports_device_skip(opt, device=torch.device("cuda"))
        for p in ps:
            p.grad = torch.full(p.shape, 0.01)
        optimizer_step(opt, found_inf=flag)
        runs.append((ps, opt))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    ps, opt = runs[1]
    before = [p.detach().clone() for p in ps], [{k: _snap(v) for k, v in opt.state[p].items()} for p in ps]
    for p in ps:
        p.grad.fill_(float("nan"))
    optimizer_step(opt, found_inf=torch.ones(()))
    assert not hasattr(opt, "found_inf")
    for p, was, st in zip(ps, before[0], before[1]):
        assert torch.equal(p.detach(), was), "a skipped step moved weights"
        assert float(opt.state[p]["step"]) == 1.0
        for k, then in st.items():
            assert all(map(torch.equal, _snap(opt.state[p][k]), then)), f"a skipped step changed {k}"
    compiled = build_optimizer(model=_Holder(_params(0)), cfg=OptimizerConfig(name="AdamW8bit",
                                                                             implementation="compiled"))
    assert isinstance(compiled, AdamW8bit) and not supports_device_skip(compiled, device=cpu)


def _snap(state: torch.Tensor) -> list[torch.Tensor]:
    """Copies of a state's tensors (torchao's state subclasses have no deepcopy)."""
    return [state.codes.clone(), state.scale.clone()] if hasattr(state, "codes") else [state.clone()]


class _Holder(nn.Module):
    def __init__(self, ps):
        super().__init__()
        self.ps = nn.ParameterList(ps)
