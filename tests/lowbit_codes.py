"""AdamW8bit's 8-bit codes found each way of ops/adamw_lowbit_triton.py (from the map's structure, checked against
the map where uncertain or everywhere, and by binary search over the map) on values that probe every decision: each map
entry and each midpoint between neighbours, a few FP32 ulps either side, the powers of ten, and random values of every
magnitude. Run under Triton's CPU interpreter by tests/unit/test_lowbit_step.py and on a GPU by
tests/gpu/test_lowbit_step_cuda.py. `python tests/lowbit_codes.py` prints the mismatches and exits 1 on any."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from torchtitan_glm.ops.adamw_lowbit_triton import (CODE_SEARCHES, _approx_code, _binary_search_code, _direct_code,
                                                    _neighbour_code)


@triton.jit
def _codes_kernel(y_ptr, out_ptr, qmap_ptr, n, SIGNED: tl.constexpr, CODES: tl.constexpr, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    if CODES == 0:
        c = _binary_search_code(y, qmap_ptr, mask)
    elif CODES == 3:
        c = _neighbour_code(y, _approx_code(y, SIGNED), qmap_ptr, mask)
    else:
        c = _direct_code(y, qmap_ptr, mask, SIGNED, CODES == 2)
    tl.store(out_ptr + offs, c, mask=mask)


def probes(qmap: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """FP32 values in [-1, 1] (unsigned map: [0, 1], as exp_avg_sq / its absmax is)."""
    mids = (qmap[:-1] + qmap[1:]) * 0.5
    base = torch.cat([qmap, mids, torch.tensor([10.0 ** e for e in range(-9, 1)]),
                      torch.tensor([0.0, 1.0, 1e-7, 1.6e-7, 2.75e-7])]).float()
    near = [base]
    up, down = base, base
    for _ in range(3):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
        near += [up, down]
    g = torch.Generator().manual_seed(0)
    near += [torch.rand(20000, generator=g), 10 ** (-9 * torch.rand(20000, generator=g))]
    y = torch.cat(near).clamp(0, 1)
    # a few FP32 ulps past 1 (x / absmax on a GPU divides approximately) and NaN
    past = torch.nextafter(torch.tensor([1.0]), torch.tensor([2.0]))
    past = torch.cat([past, torch.nextafter(past, torch.tensor([2.0]))])
    y = torch.cat([y, past, torch.tensor([float("nan")])])
    return torch.cat([y, -y]).contiguous() if signed else y.contiguous()


def mismatches(device: str) -> dict[str, int]:
    """{map: values whose code found one way differs from the searchsorted rule of ops/adamw_lowbit.py's
    reference}."""
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    out = {}
    for signed, table in ((True, get_qmap_signed()), (False, get_qmap_unsigned())):
        qmap = torch.tensor(table, dtype=torch.float32)
        y = probes(qmap, signed=signed)
        below = (torch.searchsorted(qmap, y, right=True) - 1).clamp(0, 255)
        above = (below + 1).clamp(max=255)
        ref = torch.where(y - qmap[below] >= (qmap[above] - qmap[below]) * 0.5, above, below).int()
        ref[y.isnan()] = 0  # searchsorted puts NaN past the end; torchao's comparisons all fail on it: code 0
        name = "signed" if signed else "unsigned"
        for how in CODE_SEARCHES:
            c = torch.empty(y.numel(), dtype=torch.int32, device=device)
            _codes_kernel[(triton.cdiv(y.numel(), 1024),)](y.to(device), c, qmap.to(device), y.numel(),
                                                           SIGNED=signed, CODES=CODE_SEARCHES.index(how), B=1024)
            out[f"{name}: {how} != reference"] = int((c.cpu() != ref).sum())
        out[f"{name}: probes"] = y.numel()
    return out


if __name__ == "__main__":
    result = mismatches("cuda" if torch.cuda.is_available() else "cpu")
    print(result)
    sys.exit(1 if any(v for k, v in result.items() if "!=" in k) else 0)
