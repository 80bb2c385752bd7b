"""torchrun worker for test_layouts.py: a torchao-FP8 MLP under the tensor-parallel plan (2 gloo ranks) against the
same FP8 MLP on one process, same inputs: tensorwise takes torchao's Float8Colwise/RowwiseParallel and agrees to
fp32 round-off (the same global scales); rowwise takes the plain styles, whose row-parallel down projection scales
over its local K shard, so it agrees to FP8 rounding only."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from torchtitan_glm.config import Float8Config
from torchtitan_glm.float8 import cpu_scaled_mm_takes_row_scales, convert_float8
from torchtitan_glm.models.glm5.layers import DenseMLP
from torchtitan_glm.models.glm5.parallelize import tp_plan_mlp
from torchtitan_glm.components.errors import exit_now


class Holder(torch.nn.Module):  # convert_float8 reads roles from the blocks, as in the model
    def __init__(self) -> None:
        super().__init__()
        self.mlp = DenseMLP(64, 128, swiglu_limit=10.0)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    base = Holder()
    base.mlp.init_weights(std=0.05)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    for recipe, styles, tol in (("tensorwise", ["Float8ColwiseParallel"] * 2 + ["Float8RowwiseParallel"], 1e-5),
                                ("rowwise", ["ColwiseParallel"] * 2 + ["RowwiseParallel"], 2e-2)):
        if recipe != "tensorwise" and not cpu_scaled_mm_takes_row_scales():
            print(f"rowwise skipped: torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")
            continue
        ref = copy.deepcopy(base)
        assert convert_float8(ref, cfg=Float8Config(enable=True, recipe=recipe)).converted_linears == 3
        model = copy.deepcopy(ref).mlp
        plan = tp_plan_mlp(model)
        assert [type(s).__name__ for s in plan.values()] == styles, plan
        parallelize_module(model, mesh, plan)
        xr, xm = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        yr, ym = ref.mlp(xr), model(xm)
        (yr * dy).sum().backward()
        (ym * dy).sum().backward()
        errs = {"y": rel(ym.detach(), yr.detach()), "dx": rel(xm.grad, xr.grad)}
        for name in ("gate_proj", "up_proj", "down_proj"):
            errs[name] = rel(getattr(model, name).weight.grad.full_tensor(), getattr(ref.mlp, name).weight.grad)
        assert all(e <= tol for e in errs.values()), (recipe, errs)
        assert recipe == "tensorwise" or errs["y"] > 1e-5, "rowwise was expected to scale over local shards"
        if dist.get_rank() == 0:
            print(recipe, {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
    print(f"rank {dist.get_rank()} OK", flush=True)
    dist.barrier()  # no rank tears gloo down while the other is still in a collective (an abort at exit, seen once)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main() or 0)  # no interpreter teardown after the process group is gone (see exit_now)
