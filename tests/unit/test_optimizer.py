"""optimizer.py: weight-decay groups from module declarations, AdamW implementation choice, DTensor-aware clipping."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from torchtitan_glm.components.errors import exit_now
from torchtitan_glm.components.optimizer import build_optimizer, clip_grad_norm_, param_groups, split_decay_params
from torchtitan_glm.config import OptimizerConfig


class KPoolAPE(nn.Module):
    no_weight_decay = True  # the whole module is excluded

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))


class HyperConnection(nn.Module):
    no_weight_decay_params = {"fn"}  # only `fn` is excluded; base/scale are 1-D anyway

    def __init__(self):
        super().__init__()
        self.fn = nn.Parameter(torch.randn(24, 32))
        self.other = nn.Parameter(torch.randn(3, 3))
        self.base = nn.Parameter(torch.zeros(24))
        self.scale = nn.Parameter(torch.ones(3))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(4, 6, 8))  # 3-D: decayed


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=True)
        self.norm = nn.LayerNorm(8)
        self.ape = KPoolAPE()
        self.hc = HyperConnection()
        self.experts = Experts()
        self.A_log = nn.Parameter(torch.zeros(4))
        self.frozen = nn.Parameter(torch.randn(5, 5), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(4))


def names(pairs):
    return sorted(n for n, _ in pairs)


def test_split_decay_params():
    decay, no_decay = split_decay_params(Toy())
    assert names(decay) == ["experts.gate_proj", "hc.other", "proj.weight"]
    assert names(no_decay) == ["A_log", "ape.weight", "hc.base", "hc.fn", "hc.scale", "norm.bias", "norm.weight",
                               "proj.bias"]


def test_shared_parameter_excluded_if_any_owner_excludes():
    model = Toy()
    model.tied = nn.Linear(8, 4, bias=False)
    model.tied.weight = model.ape.weight  # same Parameter under a module that would decay it
    decay, no_decay = split_decay_params(model)
    assert "ape.weight" in names(no_decay) and "tied.weight" not in names(decay)
    assert sum(p is model.ape.weight for _, p in decay + no_decay) == 1  # listed once


def test_bad_declaration_is_loud():
    class Bad(nn.Module):
        no_weight_decay_params = {"missing"}

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 2))

    with pytest.raises(ValueError, match="missing"):
        split_decay_params(Bad())


def test_param_groups_and_adamw_applies_decay_only_where_declared():
    model = Toy()
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert len(groups[0]["params"]) == 3 and len(groups[1]["params"]) == 8
    opt = build_optimizer(model=model, cfg=OptimizerConfig(lr=0.5, weight_decay=0.1))
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]  # "auto" on CPU
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()  # zero gradients: only decoupled weight decay moves parameters
    after = dict(model.named_parameters())
    for n in ("proj.weight", "hc.other", "experts.gate_proj"):
        assert torch.allclose(after[n], before[n] * (1 - 0.5 * 0.1)), n
    for n in ("proj.bias", "norm.weight", "ape.weight", "hc.fn", "A_log"):
        assert torch.equal(after[n], before[n]), n


@pytest.mark.parametrize("impl,foreach,fused", [("foreach", True, False), ("for-loop", False, False),
                                                ("fused", False, True)])
def test_implementation_choice(impl, foreach, fused):
    opt = build_optimizer(model=nn.Linear(4, 4), cfg=OptimizerConfig(implementation=impl))
    assert bool(opt.defaults["foreach"]) is foreach and bool(opt.defaults["fused"]) is fused


def test_clip_matches_torch_for_plain_tensors():
    torch.manual_seed(0)
    a, b = nn.Linear(6, 5), nn.Linear(5, 3)
    ref_a, ref_b = nn.Linear(6, 5), nn.Linear(5, 3)
    for src, dst in ((a, ref_a), (b, ref_b)):
        dst.load_state_dict(src.state_dict())
    x = torch.randn(7, 6)
    (b(a(x)).pow(2).sum() * 10).backward()
    (ref_b(ref_a(x)).pow(2).sum() * 10).backward()
    params = list(a.parameters()) + list(b.parameters())
    ref = list(ref_a.parameters()) + list(ref_b.parameters())
    norm = clip_grad_norm_(params, 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert norm > 0.5 and torch.allclose(norm, ref_norm)
    for p, q in zip(params, ref):
        assert torch.allclose(p.grad, q.grad)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])) == pytest.approx(0.5, rel=1e-4)
    assert clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0) == 0.0  # no grads at all


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dtensor_worker(rank, world, port, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)  # identical full tensors on every rank
        full = [torch.randn(8, 4), torch.randn(6), torch.randn(4, 4)]
        grads = [torch.randn_like(t) * 3 for t in full]
        placements = [[Shard(0)], [Shard(0)], [Replicate()]]  # two groups: sharded and replicated
        params = []
        for t, g, pl in zip(full, grads, placements):
            p = nn.Parameter(distribute_tensor(t, mesh, pl))
            p.grad = distribute_tensor(g.clone(), mesh, pl)  # clone: a Replicate DTensor may alias `g`
            params.append(p)
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        norm = clip_grad_norm_(params, 1.0)
        clipped = [p.grad.full_tensor() for p in params]
        torch.save({"norm": norm, "expected": expected, "clipped": clipped, "grads": grads},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # no interpreter teardown after gloo's process group (it aborted a finished rank once: see errors.exit_now)
    exit_now(0)


def test_clip_dtensor_grads_two_ranks(tmp_path):
    world = 2
    mp.start_processes(_dtensor_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert type(r["norm"]) is torch.Tensor  # a plain tensor, not a DTensor
        assert torch.allclose(r["norm"], r["expected"])  # the global norm, not a shard's
        scale = 1.0 / (r["expected"] + 1e-6)
        for c, g in zip(r["clipped"], r["grads"]):
            assert torch.allclose(c, g * scale, atol=1e-6)


# ------------------------------------------------------------------------------- [optimizer] choices (issue 12)
@pytest.mark.parametrize("keys,key", [
    ({"name": "CPUOffloadOptimizer"}, "optimizer.name"),
    ({"name": "Adam8bit"}, "optimizer.name"),
    ({"name": "AdamW8bit", "implementation": "foreach"}, "optimizer.implementation"),
    ({"name": "AdamWFp8", "cpu_offload": True}, "optimizer.cpu_offload"),
])
def test_invalid_optimizer_choices_name_the_key(keys, key):
    from torchtitan_glm.config import ConfigError

    with pytest.raises(ConfigError) as e:
        OptimizerConfig(**keys).validate()
    assert e.value.key == key
    if keys["name"] == "CPUOffloadOptimizer":
        assert "optimizer.cpu_offload = true" in str(e.value)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
def test_low_bit_optimizers_are_built_with_the_config(name):
    """The plumbing without a step (a step compiles: tests/distributed/test_optimizer_choices.py, slow)."""
    opt = build_optimizer(model=Toy(), cfg=OptimizerConfig(name=name, lr=2e-3, beta1=0.8, weight_decay=0.05))
    assert type(opt).__name__ == name and type(opt).__mro__[1].__module__ == "torchao.optim.adam"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert all(isinstance(g["lr"], torch.Tensor) and float(g["lr"]) == pytest.approx(2e-3) for g in opt.param_groups)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)


@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "AdamWFp8"])
def test_optimizer_state_bytes_match_what_the_optimizer_allocates(name):
    """optimizer_state_bytes (the start-up summary's figure) against the states the optimizer itself makes:
    torchao's own buffer constructor for the low-bit ones (no step), AdamW's moments after one step."""
    from torchtitan_glm.components.optimizer import optimizer_state_bytes

    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 3), nn.Embedding(40, 256))  # 8192, 384, 10240 values
    model[2].weight.requires_grad_(False)
    cfg = OptimizerConfig(name=name)
    opt = build_optimizer(model=model, cfg=cfg)
    if name == "AdamW":
        model[1](model[0](torch.randn(2, 64))).sum().backward()
        opt.step()
        states = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    else:
        states = [opt._new_buffer(p, signed) for p in model.parameters() if p.requires_grad for signed in (True, False)]

    def nbytes(t: torch.Tensor) -> int:
        if type(t) is torch.Tensor:
            return t.numel() * t.element_size()
        return sum(nbytes(getattr(t, a)) for a in t.__tensor_flatten__()[0])

    assert optimizer_state_bytes(model, cfg) == sum(nbytes(t) for t in states)
    if name != "AdamW":  # the 8192-value weight is quantised: ~2 bytes per value instead of 8
        assert optimizer_state_bytes(model, cfg) < 0.4 * optimizer_state_bytes(model, OptimizerConfig())


def test_lr_schedule_resume_fills_a_tensor_lr():
    from torchtitan_glm.components.lr_scheduler import build_lr_scheduler
    from torchtitan_glm.config import LRSchedulerConfig

    opt = build_optimizer(model=Toy(), cfg=OptimizerConfig(name="AdamW8bit", lr=1e-3))
    sched = build_lr_scheduler(optimizer=opt, cfg=LRSchedulerConfig(warmup_steps=2), total_steps=10)
    for _ in range(4):
        sched.step()
    want = [float(g["lr"]) for g in opt.param_groups]
    lr_tensors = [g["lr"] for g in opt.param_groups]
    fresh = build_optimizer(model=Toy(), cfg=OptimizerConfig(name="AdamW8bit", lr=1e-3))
    fresh_sched = build_lr_scheduler(optimizer=fresh, cfg=LRSchedulerConfig(warmup_steps=2), total_steps=10)
    fresh_sched.load_state_dict(sched.state_dict())
    assert [float(g["lr"]) for g in fresh.param_groups] == pytest.approx(want) and want[0] < 1e-3
    assert all(isinstance(g["lr"], torch.Tensor) for g in fresh.param_groups)
    assert all(g["lr"] is t for g, t in zip(opt.param_groups, lr_tensors))
