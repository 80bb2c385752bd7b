"""Step time and peak memory of one training forward+backward, eager vs compiled, with and without activation
checkpointing, on one device; optionally swept over sequence lengths.

    python scripts/benchmark.py --flavor glm5_3_flash_proxy --seq-len 4096 \\
        --runs eager:none,compiled:none,eager:full,compiled:full
    python scripts/benchmark.py --seq-len sweep --runs compiled:auto      # T = 4K ... 128K, the AC each T needs

Weights are BF16, no FSDP, no optimizer; one row of `--docs` packed documents, passed as train.py passes them (their
ids with a host copy), or with `--docs 1` (the default) no ids, one document per row, where DSA's plain causal rows
run without a mask (`--dsa-mask-causal-rows off` keeps the mask). `--scope train` is the trainer's
loss: fused CE + MTP layer + the indexer KL, over every visible pool (`--indexer-kl dense`, the default: the dense
warm-up's form and the sparse stage's with loss.indexer_sparse_loss = false; its dense attention target costs
O(T^2) FP32 work per DSA layer) or over the selected pools (`--indexer-kl sparse`, loss.indexer_sparse_loss = true:
linear in T). `--scope reference` drops the MTP layer and the indexer KL, the scope of the transformers figure in
docs/performance.md (trunk + LM head + CE). AC `auto` picks selective up to T = 32K and full above. A run that runs
out of memory prints a row marked OOM and the sweep goes on. A third field `fp8` in a run (`compiled:selective:fp8`)
converts the model to the FP8 serving split first (`--float8-recipe`; `--float8-moe-experts off` keeps the routed
experts BF16, and each row counts what was converted). `--profile` adds one profiled step per run and
prints its CUDA kernels by total time (on CPU its CPU ops; `--profile-rows N`, `--profile-match a,b` for the rows
naming a or b and their summed self time, on CUDA the matching kernels'); `--memory-profile` (CUDA only) prints
what is alive at each run's memory peak (or out-of-memory) by source line. `--recompute-modules kda,mhc` adds
activation_checkpoint.recompute_modules to the selective runs, `auto` ones where they are selective (their AC column
reads `selective+kda+mhc`); a run can name its own instead, `compiled:selective+kda`, so one call times several
choices side by side. Prints one JSON line per run and a markdown table (its `MoE chunk` column is
`--moe-chunk-tokens`); the proxy needs CUDA.

`--against transformers` first times transformers' own `Glm5NextTextModel` built from the same config (plus a
bias-free LM head and full-logit FP32 CE: the reference of docs/performance.md), eager, in `--dtype`, gradients
dropped each step as ours are, on the same tokens; each of our runs then starts from its weights and its row carries
`speed_ratio` (our tokens/s over transformers') and `memory_ratio` (our peak over transformers'). It implies
`--scope reference` and one document per row (the transformers model has no packed-document form). Both report the
same loss at init exactly when the indexer's scores have no ties (the proxy flavor, 32 indexer heads); the debug
flavor's indexer (4 heads, ReLU scores) makes exact ties, which ours breaks toward the earlier pool by design and
transformers' torch.topk need not, so once a row has more pools than index_topk selects its losses can differ in the
4th digit (6.30549 vs 6.30672 at T = 64, fp32; equal with 32 indexer heads):

    python scripts/benchmark.py --against transformers --seq-len 4096,8192 --runs compiled:none

Peak memory is the CUDA allocator's peak; on CPU, eager runs report the peak of live tensor storages during one
extra step (compiled CPU runs report NaN).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan_glm.components.logs import drop_benign_warnings

drop_benign_warnings()  # before torchao is imported (its import warns)
from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from torchtitan_glm.compile import apply_compile  # noqa: E402
from torchtitan_glm.components.cuda_alloc import default_alloc_conf  # noqa: E402
from torchtitan_glm.components.loss import indexer_kl_loss  # noqa: E402
from torchtitan_glm.components.memory_peak import print_breakdown, recording  # noqa: E402
from torchtitan_glm.components.metrics import flops_per_token  # noqa: E402
from torchtitan_glm.config import ActivationCheckpointConfig, ConfigError, Float8Config  # noqa: E402
from torchtitan_glm.float8 import configure_inductor_for_float8, convert_float8  # noqa: E402
from torchtitan_glm.models.glm5 import Glm5Model, Glm5ModelArgs, get_flavor  # noqa: E402
from torchtitan_glm.models.glm5.args import FLAVORS  # noqa: E402
from torchtitan_glm.models.glm5.batch import train_batch  # noqa: E402
from torchtitan_glm.models.glm5.hf_modeling import modeling_to_ours  # noqa: E402


SWEEP = (4096, 8192, 16384, 32768, 65536, 131072)


def reset_host_peak() -> None:
    """Restart the kernel's count of this process's peak resident memory (VmHWM; Linux >= 4.0), so that each run of a
    sweep reports its own peak; elsewhere the peak stays the process's so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _proc_status_gib(*keys: str) -> dict[str, float]:
    """Fields of /proc/self/status (kB) in GiB; empty where there is no such file."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in keys:
                    out[key] = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return out


def host_peak_rss_gib() -> float:
    """This process's peak resident host memory (pinned offload buffers included) since reset_host_peak, GiB."""
    peak = _proc_status_gib("VmHWM").get("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux KiB; the lifetime peak


def host_memory_gib(device: torch.device) -> dict[str, float]:
    """This process's resident host memory now, by kind (RssAnon, RssFile, RssShmem of /proc/self/status), and on
    CUDA what torch's pinned-memory caching allocator holds ("pinned_reserved") and hands out ("pinned_allocated"):
    to tell pinned offload buffers from other host growth (the compiled 128K run's host OOM, docs/performance.md)."""
    out = {k[3:].lower(): round(v, 2) for k, v in _proc_status_gib("RssAnon", "RssFile", "RssShmem").items()}
    if device.type == "cuda":
        try:
            stats = torch.cuda.host_memory_stats()
            out["pinned_reserved"] = round(stats.get("reserved_bytes.current", 0) / 2**30, 2)
            out["pinned_allocated"] = round(stats.get("allocated_bytes.current", 0) / 2**30, 2)
        except (AttributeError, RuntimeError):
            pass
    return out


def auto_ac(seq_len: int) -> str:
    """Activation checkpointing for the proxy on one H200 (139 GiB): selective up to 32K tokens, full above."""
    return "selective" if seq_len <= 32768 else "full"


class CpuPeak(TorchDispatchMode):
    """Peak bytes of the tensor storages alive during a CPU step, on top of the given ones (the CPU allocator keeps
    no peak count as CUDA's does)."""

    def __init__(self, resident: list[torch.Tensor]) -> None:
        super().__init__()
        self.base = {StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in resident}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "torchtitan_glm":
            # The project's custom ops allocate inside their kernels, below this mode: run the CPU kernel with the
            # mode active again, so its temporaries are counted too.
            with self:
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        self._record(out)
        return out

    def _record(self, out) -> None:
        new = False
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ref = StorageWeakRef(t.untyped_storage())
                known = self.live.get(ref.cdata)
                if ref.cdata not in self.base and (known is None or known[0].expired()):
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
                    new = True
        if new:
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))

    @property
    def peak_bytes(self) -> int:
        return sum(self.base.values()) + self.peak


def make_inputs(*, vocab: int, seq_len: int, batch: int, docs: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens (seeded, the same for every run and model), next-token labels (-100 across document ends and
    at the row end) and document ids of equal lengths (to within one token)."""
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    doc_ids = (torch.arange(seq_len, device=device) * docs // seq_len).expand(batch, seq_len)
    labels[:, :-1].masked_fill_(doc_ids[:, 1:] != doc_ids[:, :-1], -100)
    return tokens, labels, doc_ids


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.cpu().numpy().tobytes()).hexdigest()[:16]


def time_steps(step: Callable[[], torch.Tensor], *, params: list[torch.Tensor], steps: int, warmup: int,
               device: torch.device, eager: bool) -> dict:
    """Median step time, peak memory (GiB) and warm-up time of `step` (which returns its loss), and that loss."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    elif eager:
        with CpuPeak(params) as mem:
            loss = step()
        peak = mem.peak_bytes / 2**30
    else:
        peak = float("nan")
    return dict(step_s=statistics.median(times), peak=peak, warmup_s=warmup_s, loss=float(loss))


def transformers_config(args: Glm5ModelArgs):
    """transformers' Glm5NextTextConfig for our model args."""
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig(**{k: v for k, v in args.to_hf_config().items()
                                 if k not in ("model_type", "architectures")})


def run_transformers(*, args: Glm5ModelArgs, flavor: str, seq_len: int, batch: int, steps: int, warmup: int,
                     device: torch.device, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """Time transformers' model (eager, LM head + full-logit CE); its row, and its weights (on the CPU) under our
    names for our runs to start from."""
    if device.type != "cuda":  # FLA's Triton kernels need CUDA; hidden, transformers takes its torch path
        sys.modules.setdefault("fla", None)
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    cfg = transformers_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        trunk = Glm5NextTextModel(cfg).to(dtype)
        head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=dtype)
    tokens, labels, _ = make_inputs(vocab=args.vocab_size, seq_len=seq_len, batch=batch, docs=1, device=device)
    params = list(trunk.parameters()) + list(head.parameters())

    def step() -> torch.Tensor:
        logits = head(trunk(input_ids=tokens).last_hidden_state).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss.backward()
        for p in params:
            p.grad = None
        return loss.detach()

    timed = time_steps(step, params=params + list(trunk.buffers()), steps=steps, warmup=warmup, device=device,
                       eager=True)
    weights = {k: v.detach().to("cpu", copy=True)
               for k, v in {**modeling_to_ours(trunk.state_dict()), "lm_head.weight": head.weight}.items()}
    tps = batch * seq_len / timed["step_s"]
    row = dict(flavor=flavor, scope="reference", indexer_kl=None, seq_len=seq_len, batch=batch,
               mode="transformers", ac="none", float8="off", step_ms=round(timed["step_s"] * 1e3, 2),
               tokens_per_s=round(tps, 1), peak_mem_gib=round(timed["peak"], 4), warmup_s=round(timed["warmup_s"], 1),
               tflops=round(tps * flops_per_token(args, seq_len) / 1e12, 1), loss=timed["loss"],
               tokens_sha1=digest(tokens), attn_implementation=cfg._attn_implementation)
    del trunk, head, params, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, weights


def model_args(flavor: str, *, scope: str, tile_elements: int, dsa_dense_max_len: int | None = None,
               dsa_mask_query_chunk: int | None = None, dsa_mask_causal_rows: bool = True) -> Glm5ModelArgs:
    args = get_flavor(flavor).replace(indexer_tile_elements=tile_elements, dsa_mask_causal_rows=dsa_mask_causal_rows)
    if dsa_dense_max_len is not None:
        args = args.replace(dsa_dense_max_len=dsa_dense_max_len)
    if dsa_mask_query_chunk is not None:
        args = args.replace(dsa_mask_query_chunk=dsa_mask_query_chunk)
    return args if scope == "train" else dataclasses.replace(args, num_nextn_predict_layers=0)


def matched_self_us(picked, *, cuda: bool) -> float:
    """Summed self time (us) of profiled rows. On CUDA only the kernels' rows count: an op's self CUDA time is its
    kernels' time, so an op row and its kernel row both matching would count those kernels twice (a torchao cast op
    and its Triton kernel, 2026-12-06). On CPU ops' self CPU times exclude their children, so they add up."""
    if not cuda:
        return sum(e.self_cpu_time_total for e in picked)
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in picked if e.device_type == DeviceType.CUDA)


def profile_table(events, *, cuda: bool, rows: int, match: tuple[str, ...] = ()) -> str:
    """torch.profiler's key averages by total time (CUDA kernels' on CUDA, ops' on CPU), `rows` of them; with
    `match`, only the rows whose name contains one of those substrings (case-insensitive), and a last line with
    their count and summed self time (matched_self_us: the kernels' on CUDA, so name the kernels to count)."""
    from torch.autograd.profiler_util import EventList

    sort_by = "cuda_time_total" if cuda else "cpu_time_total"
    if not match:
        return events.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)
    picked = EventList([e for e in events if any(m.lower() in e.key.lower() for m in match)])
    table = picked.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60) if len(picked) else ""
    what = "CUDA kernels' self time" if cuda else "self CPU time"
    return (f"{table}\nrows matching {', '.join(match)}: {len(picked)}, their {what} summed: "
            f"{matched_self_us(picked, cuda=cuda) / 1e3:.3f} ms")


def oom_text(e: BaseException) -> str:
    """The OOM's first two sentences: that it ran out, and how much the failing allocation asked for."""
    return ". ".join(str(e).split(". ")[:2])


def run_one(*, flavor: str, seq_len: int, batch: int, compiled: bool, ac: str, steps: int, warmup: int,
            device: torch.device, dtype: torch.dtype, backend: str, scope: str, profile: bool, indexer_kl: str,
            docs: int, tile_elements: int, float8: str | None = None,
            weights: dict[str, torch.Tensor] | None = None, recompute_modules: tuple[str, ...] = (),
            dsa_dense_max_len: int | None = None, dsa_mask_query_chunk: int | None = None,
            dsa_mask_causal_rows: bool = True, memory_profile: bool = False, moe_chunk_tokens: int = 0,
            offload_inputs: bool = False, float8_moe_experts: bool = True, profile_rows: int = 30,
            profile_match: tuple[str, ...] = (), kda_disable_recompute: bool = False) -> dict:
    """One timed run of this repo's model; from `weights` (our names) when given, else from its own init."""
    args = model_args(flavor, scope=scope, tile_elements=tile_elements, dsa_dense_max_len=dsa_dense_max_len,
                      dsa_mask_query_chunk=dsa_mask_query_chunk, dsa_mask_causal_rows=dsa_mask_causal_rows)
    train_scope = scope == "train"
    reset_host_peak()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Glm5Model(args)
    model.to_empty(device=device)
    model.init_weights()  # every buffer set, whether or not the state dict carries it
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    model.to(dtype)
    f8 = Float8Config(enable=float8 is not None, recipe=float8 or "tensorwise", moe_experts=float8_moe_experts)
    converted = convert_float8(model, cfg=f8)  # the serving split, exactly as the trainer converts
    configure_inductor_for_float8(cfg=f8)
    recompute_modules = recompute_modules if ac == "selective" else ()
    apply_activation_checkpointing(model, mode=ac, recompute_modules=recompute_modules,
                                   moe_chunk_tokens=moe_chunk_tokens, offload_inputs=offload_inputs and ac == "full",
                                   kda_disable_recompute=kda_disable_recompute)
    if compiled:
        apply_compile(model, backend=backend, components=["model", "loss"])
    tokens, labels, doc_ids = make_inputs(vocab=args.vocab_size, seq_len=seq_len, batch=batch, docs=docs,
                                          device=device)
    n = int((labels != -100).sum())  # the loss is the mean CE over the counted tokens
    # the batch as callers give it: one document per row, no ids (as transformers is called); packed documents,
    # their ids with the loader's host copy, as train.py passes them (the KDA op then reads no device value)
    batch_in = train_batch(tokens, labels, None) if docs == 1 else train_batch(tokens, labels, doc_ids,
                                                                                  host_doc_ids=doc_ids.cpu())

    def step() -> torch.Tensor:
        out = model(batch_in, token_scale=1.0 / n,
                    mtp_scale=0.1 / n if train_scope else 0.0, indexer_kl=indexer_kl if train_scope else None)
        loss = (out.loss + indexer_kl_loss(out.indexer_stats)) if train_scope else out.loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return out.loss.detach()

    with recording(memory_profile):
        try:
            timed = time_steps(step, params=list(model.parameters()) + list(model.buffers()), steps=steps,
                               warmup=warmup, device=device, eager=not compiled)
        finally:  # also when out of memory: what was alive then
            if memory_profile:
                mode = "compiled" if compiled else "eager"
                print_breakdown(torch.cuda.memory._snapshot(), title=f"T={seq_len} {mode} AC {ac} (the weights, "
                                "allocated before recording, not included)")
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        print(profile_table(prof.key_averages(), cuda=device.type == "cuda", rows=profile_rows,
                            match=profile_match), flush=True)
    tps = batch * seq_len / timed["step_s"]
    offloaded = offload_inputs and ac == "full"
    calls = steps + warmup + (device.type != "cuda" and not compiled)
    offloaded_gib = model.block_offload.offloaded_bytes / calls / 2**30 if offloaded else 0.0
    ac_label = run_label(ac, recompute_modules) + ("+offload" if offloaded else "")
    result = dict(flavor=flavor, scope=scope, indexer_kl=indexer_kl if train_scope else None, seq_len=seq_len,
                  batch=batch, mode="compiled" if compiled else "eager",
                  ac=ac_label, float8=float8 or "off", float8_linears=converted.converted_linears,
                  float8_expert_weights=converted.grouped_expert_weights,
                  step_ms=round(timed["step_s"] * 1e3, 2), tokens_per_s=round(tps, 1),
                  peak_mem_gib=round(timed["peak"], 4), warmup_s=round(timed["warmup_s"], 1),
                  tflops=round(tps * flops_per_token(args, seq_len) / 1e12, 1), loss=timed["loss"],
                  tokens_sha1=digest(tokens), dsa_dense_max_len=args.dsa_dense_max_len,
                  dsa_mask_query_chunk=args.dsa_mask_query_chunk,
                  # whether any DSA row ran the causal kernel unmasked: one document, on the masked path
                  dsa_mask_causal_rows=args.dsa_mask_causal_rows and docs == 1 and args.dense_dsa_kernel(seq_len),
                  moe_chunk_tokens=moe_chunk_tokens, offload_inputs=offloaded,
                  kda_disable_recompute=kda_disable_recompute,
                  offloaded_gib_per_step=round(offloaded_gib, 3), host_peak_rss_gib=round(host_peak_rss_gib(), 2),
                  host_gib_after=host_memory_gib(device))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def add_ratios(row: dict, reference: dict | None) -> None:
    """speed_ratio (tokens/s) and memory_ratio (peak) of one of our rows over the transformers row at its T."""
    if reference is None or "oom" in reference or "oom" in row:
        return
    row["speed_ratio"] = round(row["tokens_per_s"] / reference["tokens_per_s"], 3)
    mem = row["peak_mem_gib"] / reference["peak_mem_gib"]
    row["memory_ratio"] = round(mem, 3) if math.isfinite(mem) else float("nan")


def run_label(ac: str, recompute_modules: tuple[str, ...]) -> str:
    """A row's AC column: the mode, and a selective run's recompute_modules (`selective+kda+mhc`, as --runs reads)."""
    return ac + "".join(f"+{m}" for m in recompute_modules) if ac == "selective" else ac


def _parse_runs(p: argparse.ArgumentParser, text: str,
                default_recompute: tuple[str, ...]) -> list[tuple[str, str, bool, tuple[str, ...]]]:
    """--runs as (mode, ac, fp8, recompute_modules); argparse's error (exit 2) naming the bad spec. A selective run
    names its recompute_modules after `+` (`selective+kda+mhc`), or takes --recompute-modules'."""
    runs = []
    for spec in text.split(","):
        parts = spec.split(":")
        ac, *own = parts[1].split("+") if len(parts) > 1 else ("",)
        if not (len(parts) in (2, 3) and parts[0] in ("eager", "compiled")
                and ac in ("none", "full", "selective", "auto") and parts[2:] in ([], ["fp8"])
                and (not own or ac == "selective")):
            p.error(f"--runs: {spec!r} is not mode:ac[:fp8] with mode in {{eager, compiled}} and ac in {{none, full, "
                    "selective, auto}, or selective+module+... naming its recompute_modules")
        try:  # the trainer's own check of the names (moe_act accepted, duplicates refused)
            ActivationCheckpointConfig(mode="selective", recompute_modules=own).validate()
        except ConfigError as e:
            p.error(f"--runs: {spec!r}: {e.message}")
        recompute = tuple(own) or (default_recompute if ac in ("selective", "auto") else ())
        runs.append((parts[0], ac, len(parts) == 3, recompute))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="glm5_3_flash_proxy")
    p.add_argument("--seq-len", default="4096", help="T, comma-separated Ts, or 'sweep' (4K, 8K, ..., 128K)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=1,
                   help="documents packed in each row (equal lengths, to within one token)")
    p.add_argument("--runs", default="eager:none,compiled:none,eager:full,compiled:full",
                   help="comma-separated mode:ac[:fp8] specs, mode in {eager, compiled}, ac in {none, full, selective, "
                        "auto}; a third field fp8 runs the FP8 serving split ([float8] defaults, --float8-recipe); "
                        "selective+kda+mhc names that run's recompute_modules")
    p.add_argument("--recompute-modules", default="",
                   help="activation_checkpoint.recompute_modules for the selective (and auto) runs that name none "
                        "of their own, comma-separated (kda, mhc, indexer, mla_up_proj, sparse_attn, moe, mlp; "
                        "moe_act, as train.py takes it)")
    p.add_argument("--moe-chunk-tokens", type=int, default=0,
                   help="activation_checkpoint.moe_chunk_tokens: routed experts over checkpointed token chunks "
                        "(0 = off)")
    p.add_argument("--offload-inputs", action="store_true",
                   help="activation_checkpoint.offload_inputs for the full-AC runs: their blocks' saved inputs in "
                        "pinned host memory")
    p.add_argument("--kda-disable-recompute", action="store_true",
                   help="activation_checkpoint.kda_disable_recompute: the KDA kernel keeps its forward intermediates "
                        "for backward (FLA's disable_recompute; rows without document ids: --docs 1)")
    p.add_argument("--float8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--float8-moe-experts", choices=["on", "off"], default="on",
                   help="float8.moe_experts of the fp8 runs: off keeps the routed experts' grouped GEMMs in BF16 "
                        "(what the dense projections' conversion alone gives)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--scope", choices=["train", "reference"], default=None,
                   help="train (the default) or reference (the default, and the only choice, with --against)")
    p.add_argument("--against", choices=["transformers"], default=None,
                   help="time transformers' glm5_next first at each T and print our speed and memory ratios to it")
    p.add_argument("--indexer-kl", choices=["sparse", "dense"], default="dense",
                   help="the trainer's default (loss.indexer_sparse_loss = false) is dense")
    p.add_argument("--indexer-tile-elements", type=int, default=0,
                   help="loss.indexer_tile_elements (default: 2^28 on CUDA, 2^26 on CPU)")
    p.add_argument("--dsa-dense-max-len", default="",
                   help="model.dsa_dense_max_len, comma-separated to time each (default: the flavor's); e.g. 0,6144 "
                        "times the sparse kernel and the short-row dense kernel side by side")
    p.add_argument("--dsa-mask-query-chunk", default="",
                   help="model.dsa_mask_query_chunk, comma-separated to time each (default: the flavor's); e.g. "
                        "0,1024 times masked SDPA in one call and in causal query chunks of 1,024 rows")
    p.add_argument("--dsa-mask-causal-rows", choices=["on", "off"], default="on",
                   help="model.dsa_mask_causal_rows: with one document per row, the DSA rows whose mask is plain "
                        "causal run SDPA's causal kernel without the mask (off: under the mask, as before)")
    p.add_argument("--profile", action="store_true",
                   help="one more step per run under torch.profiler: its CUDA kernels (on CPU its ops) by total time")
    p.add_argument("--profile-rows", type=int, default=30, help="--profile: how many rows of its table (default 30)")
    p.add_argument("--profile-match", default="",
                   help="--profile: only the rows whose name contains one of these comma-separated substrings "
                        "(case-insensitive), and their summed self time (on CUDA the matching kernels' only, so an op "
                        "and its kernel are not counted twice); e.g. _triton_fp8 for torchao's FP8 cast kernels")
    p.add_argument("--memory-profile", action="store_true",
                   help="CUDA only: record CUDA allocations and print what is alive at each run's peak (or "
                        "out-of-memory) by the source line that allocated it (components/memory_peak.py); timings "
                        "include the recorder")
    p.add_argument("--out", default="")
    a = p.parse_args()
    default_alloc_conf()  # expandable segments, as train.py runs (unless PYTORCH_CUDA_ALLOC_CONF is set)
    if a.against:
        if a.scope == "train" or a.docs != 1:
            p.error("--against transformers compares the reference scope (trunk + LM head + CE) on one document per "
                    "row: drop --scope train / --docs")
        a.scope = "reference"
    a.scope = a.scope or "train"
    recompute = tuple(m for m in a.recompute_modules.split(",") if m)
    try:  # the trainer's own check of the names (moe_act accepted, duplicates refused)
        ActivationCheckpointConfig(mode="selective", recompute_modules=list(recompute)).validate()
    except ConfigError as e:
        p.error(f"--recompute-modules: {e.message}")
    try:
        seq_lens = SWEEP if a.seq_len == "sweep" else tuple(int(t) for t in a.seq_len.split(","))
    except ValueError:
        p.error(f"--seq-len: a token count, comma-separated counts, or 'sweep'; got {a.seq_len!r}")
    if min(seq_lens) < 1:
        p.error(f"--seq-len: token counts must be >= 1, got {a.seq_len!r}")
    runs = _parse_runs(p, a.runs, recompute)
    for key, value, low in (("--batch", a.batch, 1), ("--docs", a.docs, 1), ("--steps", a.steps, 1),
                            ("--warmup", a.warmup, 0), ("--moe-chunk-tokens", a.moe_chunk_tokens, 0),
                            ("--indexer-tile-elements", a.indexer_tile_elements, 0)):
        if value < low:
            p.error(f"{key} must be >= {low}, got {value}")
    if a.docs > min(seq_lens) // 2:
        p.error(f"--docs {a.docs}: a row of {min(seq_lens)} tokens holds at most {min(seq_lens) // 2} documents "
                "of the 2 tokens a next-token label needs")
    if a.flavor not in FLAVORS:
        p.error(f"--flavor {a.flavor!r} is unknown; choose one of {sorted(FLAVORS)}")
    if a.out and (os.path.isdir(a.out) or not os.path.isdir(os.path.dirname(os.path.abspath(a.out)))):
        p.error(f"--out {a.out}: not a file in an existing folder (it is written after every run)")
    if recompute and not any(ac in ("selective", "auto") for _, ac, _, _ in runs):
        p.error("--recompute-modules refines selective AC: no run in --runs is ':selective' (or ':auto')")
    if a.kda_disable_recompute and a.docs > 1:
        p.error(f"--kda-disable-recompute needs rows without document ids (--docs 1, as data.document_masking = false "
                f"in train.py), got --docs {a.docs}")
    if a.offload_inputs and not any(ac in ("full", "auto") for _, ac, _, _ in runs):
        p.error("--offload-inputs offloads what full AC saves: no run in --runs is ':full' (or ':auto')")
    try:
        dense_max_lens = tuple(int(v) for v in a.dsa_dense_max_len.split(",")) if a.dsa_dense_max_len else (None,)
    except ValueError:
        p.error(f"--dsa-dense-max-len: comma-separated integers, got {a.dsa_dense_max_len!r}")
    if any(v is not None and v < 0 for v in dense_max_lens):
        p.error(f"--dsa-dense-max-len: must be >= 0 (0: always the sparse kernel), got {a.dsa_dense_max_len!r}")
    try:
        mask_chunks = (tuple(int(v) for v in a.dsa_mask_query_chunk.split(",")) if a.dsa_mask_query_chunk
                       else (None,))
    except ValueError:
        p.error(f"--dsa-mask-query-chunk: comma-separated integers, got {a.dsa_mask_query_chunk!r}")
    if any(c is not None and c < 0 for c in mask_chunks):
        p.error(f"--dsa-mask-query-chunk: must be >= 0 (0: one call), got {a.dsa_mask_query_chunk!r}")
    if a.profile_rows < 1:
        p.error(f"--profile-rows {a.profile_rows}: print at least one row")
    if not a.profile and (a.profile_match or a.profile_rows != 30):
        p.error("--profile-rows / --profile-match shape --profile's table: add --profile")
    if a.memory_profile and not torch.cuda.is_available():
        p.error("--memory-profile records CUDA allocations (torch.cuda.memory): it needs CUDA and none is visible")
    if not torch.cuda.is_available() and a.flavor != "debug":
        print(f"benchmark.py: flavor {a.flavor!r} needs a CUDA GPU and none is visible; on CPU use --flavor debug",
              file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tile_elements = a.indexer_tile_elements or (1 << 28 if device.type == "cuda" else 1 << 26)
    rows = []

    def emit(r: dict) -> None:
        print(json.dumps(r), flush=True)
        rows.append(r)
        if a.out:  # after every run, so a run cut off by a time limit keeps the ones before it
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)

    for seq_len in seq_lens:
        reference, weights = None, None
        if a.against:
            args = model_args(a.flavor, scope="reference", tile_elements=tile_elements)
            try:
                reference, weights = run_transformers(args=args, flavor=a.flavor, seq_len=seq_len, batch=a.batch,
                                                      steps=a.steps, warmup=a.warmup, device=device,
                                                      dtype=getattr(torch, a.dtype))
            except torch.cuda.OutOfMemoryError as e:
                reference = dict(flavor=a.flavor, scope="reference", seq_len=seq_len, mode="transformers", ac="none",
                                 float8="off", oom=oom_text(e))
            if "oom" in reference:
                gc.collect()
                torch.cuda.empty_cache()
            emit(reference)
        for (mode, ac, fp8, run_recompute), dense_max, mask_chunk in ((run, dm, mc) for dm in dense_max_lens
                                                       for mc in mask_chunks for run in runs):
            ac = auto_ac(seq_len) if ac == "auto" else ac
            try:
                r = run_one(flavor=a.flavor, seq_len=seq_len, batch=a.batch, compiled=mode == "compiled", ac=ac,
                            steps=a.steps, warmup=a.warmup, device=device, dtype=getattr(torch, a.dtype),
                            backend=a.backend, scope=a.scope, profile=a.profile, indexer_kl=a.indexer_kl, docs=a.docs,
                            tile_elements=tile_elements, float8=a.float8_recipe if fp8 else None,
                            weights=weights, recompute_modules=run_recompute, dsa_dense_max_len=dense_max,
                            dsa_mask_query_chunk=mask_chunk, dsa_mask_causal_rows=a.dsa_mask_causal_rows == "on",
                            memory_profile=a.memory_profile,
                            moe_chunk_tokens=a.moe_chunk_tokens, offload_inputs=a.offload_inputs,
                            kda_disable_recompute=a.kda_disable_recompute,
                            float8_moe_experts=a.float8_moe_experts == "on", profile_rows=a.profile_rows,
                            profile_match=tuple(m for m in a.profile_match.split(",") if m))
            except torch.cuda.OutOfMemoryError as e:
                r = dict(flavor=a.flavor, scope=a.scope, seq_len=seq_len, mode=mode, ac=run_label(ac, run_recompute),
                         float8=a.float8_recipe if fp8 else "off", moe_chunk_tokens=a.moe_chunk_tokens,
                         dsa_dense_max_len=dense_max, dsa_mask_query_chunk=mask_chunk, oom=oom_text(e))
            if "oom" in r:  # outside the handler: its traceback no longer holds the model
                gc.collect()
                torch.cuda.empty_cache()
                torch._dynamo.reset()
            add_ratios(r, reference)
            emit(r)
        del weights
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}\n")
    kl = f", indexer KL {a.indexer_kl}, indexer tiles of {tile_elements} elements" if a.scope == "train" else ""
    causal = f", DSA plain causal rows {a.dsa_mask_causal_rows}" if a.docs == 1 else ""
    print(f"scope: {a.scope}{kl}, {a.docs} document(s) per row{causal}\n")
    vs = " | speed / memory vs transformers" if a.against else ""
    print(f"| T | mode | AC | float8 | DSA dense max | mask query chunk | MoE chunk | step ms | tokens/s | TFLOP/s | "
          f"peak GiB | warm-up s | loss{vs} |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
          + ("---|" if a.against else ""))
    for r in rows:
        f8 = r["float8"]
        if r.get("float8_linears"):  # what was converted, counted from the model
            f8 += f" ({r['float8_linears']} Linear, {r['float8_expert_weights']} expert weights)"
        options = (f"{f8} | {r.get('dsa_dense_max_len', '')} | {r.get('dsa_mask_query_chunk', '')} | "
                   f"{r.get('moe_chunk_tokens', '')}")
        if "oom" in r:
            print(f"| {r['seq_len']:,} | {r['mode']} | {r['ac']} | {options} | OOM | | | | | |"
                  + (" |" if a.against else ""))
            continue
        ratio = ""
        if a.against:
            ratio = f" {r['speed_ratio']}x, {r['memory_ratio']}x |" if "speed_ratio" in r else " |"
        print(f"| {r['seq_len']:,} | {r['mode']} | {r['ac']} | {options} | {r['step_ms']} | "
              f"{r['tokens_per_s']:,.0f} | {r['tflops']} | {r['peak_mem_gib']} | {r['warmup_s']} | "
              f"{r['loss']:.6g} |{ratio}")


if __name__ == "__main__":
    main()
