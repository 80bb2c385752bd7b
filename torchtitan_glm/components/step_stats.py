"""A training step's statistics kept on the device, and the optimizer step that drops a non-finite update there.

Reading a device value on the host (`.item()`, `float()`, a blocking copy) waits for every kernel queued before it:
once per step, it empties the GPU's queue while the host prepares the next step. So a step only queues work:
`StepStats.record` all-reduces its sums (and this rank's stop request) over the world and derives, on the device,
the logged values and whether any of them is non-finite; `finish` starts their copy to pinned host memory. The host
reads them later (`resolve`): on log steps, before a checkpoint, at the end of the run and when it stops, and
otherwise one step late, when that step's copy is long done (the host then waits only for the previous step while
this one's kernels keep the GPU busy; its `torch.cuda.Event.synchronize` does not trip
`torch.cuda.set_sync_debug_mode`).

The non-finite guard (training.on_nonfinite) must not apply a non-finite update: `optimizer_step` passes the flag
to torch's fused AdamW and to the fused low-bit AdamW step (components/lowbit_step.py) as `found_inf` (the
GradScaler protocol: the kernel leaves parameters, moments and step counts untouched when it is 1), so the decision
never leaves the device. Optimizers without that protocol (foreach / for-loop AdamW, torchao's compiled low-bit
step, CPU-offloaded steps) read the one flag on the host before stepping: one sync per step. Every rank takes the
same decision: the flag derives from world-reduced values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CHECKED", "PendingStep", "StepStats", "supports_device_skip", "optimizer_step", "is_host_copy"]

# The values whose finiteness the guard checks, in the order of the "bad" bits.
CHECKED = ("loss", "mtp_loss", "indexer_kl_loss", "grad_norm")
_HOST = ("loss", "mtp_loss", "indexer_kl_loss", "grad_norm", "tokens", "mtp_tokens", "stop") + tuple(
    f"bad_{k}" for k in CHECKED)


@dataclass
class PendingStep:
    """One step's statistics on their way to the host."""

    step: int
    lr: float
    documents: list[str]  # where the step's batch came from (named if it turns out non-finite)
    has: frozenset[str]  # which of CHECKED this step computed
    values: torch.Tensor  # [len(_HOST)] FP32 on the device
    bad: torch.Tensor  # 0-dim FP32 on the device: 1.0 if any checked value is not finite
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # more device scalars (expert_load_imbalance)
    host: torch.Tensor | None = None  # the values (then the extras) on the host, once copied
    event: Any = None  # CUDA event recorded after the copy was queued


def supports_device_skip(optimizer: torch.optim.Optimizer, *, device: torch.device) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` flag on `device` without the host: torch's fused Adam/AdamW,
    or an optimizer that says so (`supports_found_inf`: the fused low-bit AdamWs), with every parameter on that
    device type (a step on host parameters would read a flag still being copied)."""
    on_device = all(p.device.type == device.type for g in optimizer.param_groups for p in g["params"])
    if getattr(optimizer, "supports_found_inf", False):
        return on_device
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and on_device and all(
        g.get("fused", False) for g in optimizer.param_groups)


def optimizer_step(optimizer: torch.optim.Optimizer, *, found_inf: torch.Tensor | None) -> None:
    """optimizer.step(), a no-op where found_inf is 1 (device flag; needs `supports_device_skip`)."""
    if found_inf is None:
        optimizer.step()
        return
    optimizer.found_inf = found_inf  # read by torch.optim.Adam.step (as torch.amp.GradScaler sets it), and ours
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def is_host_copy(t: torch.Tensor) -> bool:
    """Whether `t` is a host copy made by `StepStats.finish` (pinned host memory on a GPU run): reading it is not a
    device sync (tests that count syncs on CPU, where every tensor is a host tensor, exempt these)."""
    return bool(getattr(t, "_ttg_host_copy", False))


class StepStats:
    """Pending steps, recorded in order and resolved in order (see the module docstring)."""

    def __init__(self, *, device: torch.device, tp: int = 1, dp_size: int = 1) -> None:
        self.device, self.tp, self.dp_size = device, tp, dp_size
        self.pending: list[PendingStep] = []

    def record(self, *, step: int, lr: float, documents: list[str], ce_sum: torch.Tensor,
               mtp_sum: torch.Tensor | None, kl: torch.Tensor | None, grad_norm: torch.Tensor, count: torch.Tensor,
               mtp_count: torch.Tensor | None, stop: bool) -> PendingStep:
        """Reduce this rank's CE / MTP-CE sums, indexer KL and stop request over the world (one all-reduce, no host
        sync) and derive the logged values and the non-finite flag on the device."""
        dev = ce_sum.device
        zero = torch.zeros((), device=dev)
        grad_norm = grad_norm.to(dev, torch.float32)
        sums = torch.stack([ce_sum.float(), zero if mtp_sum is None else mtp_sum.float(),
                            zero if kl is None else kl.detach().float(), torch.full((), float(stop), device=dev),
                            (~torch.isfinite(grad_norm)).float()])
        if dist.is_initialized():
            dist.all_reduce(sums)  # over the world: every rank shares the stop decision and the non-finite flag
            sums[:3] /= self.tp  # tensor-parallel ranks hold identical copies of their data ranks' sums
        count = count.float()
        mtp_count = zero if mtp_count is None else mtp_count.float()
        loss = sums[0] / count
        mtp_loss = sums[1] / mtp_count.clamp_min(1)
        kl_loss = sums[2] / self.dp_size
        has = frozenset({"loss", "grad_norm"} | ({"mtp_loss"} if mtp_sum is not None else set())
                        | ({"indexer_kl_loss"} if kl is not None else set()))
        bits = torch.stack([~torch.isfinite(loss), ~torch.isfinite(mtp_loss) & (mtp_sum is not None),
                            ~torch.isfinite(kl_loss) & (kl is not None), sums[4] > 0]).float()
        values = torch.cat([torch.stack([loss, mtp_loss, kl_loss, grad_norm, count, mtp_count,
                                         (sums[3] > 0).float()]), bits])
        pending = PendingStep(step=step, lr=lr, documents=documents, has=has, values=values, bad=bits.amax())
        self.pending.append(pending)
        return pending

    def finish(self, pending: PendingStep) -> None:
        """Queue the copy of the step's values (and extras) to the host; the host reads them in `resolve`."""
        flat = torch.cat([pending.values] + [t.reshape(1).to(pending.values) for t in pending.extra.values()])
        if flat.device.type == "cuda":
            pending.host = flat.to("cpu", non_blocking=True)  # pinned, asynchronous
            pending.event = torch.cuda.Event()
            pending.event.record()
        else:
            pending.host = flat.clone()
        pending.host._ttg_host_copy = True  # type: ignore[attr-defined]

    def flag_now(self, pending: PendingStep) -> bool:
        """Whether the step is finite, read now: the one host sync of optimizers without `found_inf`."""
        return not bool(pending.bad.item())

    def resolve(self, upto: int) -> list[dict[str, Any]]:
        """The metrics of the pending steps up to `upto`, oldest first, as plain Python values: every CHECKED value
        the step has, "lr", "tokens", "step", "documents", "stop" (a rank asked to stop), "nonfinite" (the checked
        values that were not finite, as "name value" strings) and the extras of finite steps."""
        out = []
        while self.pending and self.pending[0].step <= upto:
            p = self.pending.pop(0)
            if p.host is None:
                self.finish(p)
            if p.event is not None:
                p.event.synchronize()
            vals = p.host.tolist()
            named = dict(zip(_HOST, vals))
            m: dict[str, Any] = {k: named[k] for k in CHECKED if k in p.has}
            m.update(step=p.step, lr=p.lr, tokens=int(named["tokens"]), documents=p.documents,
                     stop=named["stop"] > 0)
            m["nonfinite"] = [f"{k} {m[k]}" for k in CHECKED if k in p.has and named[f"bad_{k}"] > 0]
            if not m["nonfinite"]:
                m.update(zip(p.extra, vals[len(_HOST):]))
            out.append(m)
        return out
