"""Activation checkpointing per decoder block (and the MTP layer): none | full | selective, and on top of selective
a per-module choice of what else is recomputed (`recompute_modules`, as Megatron's recompute_modules refines its
selective granularity).

Full recomputes the whole block, mHC mixing included; the block is a pure function of its inputs, so the
recomputed forward re-reads the saved residual streams and never adds them twice. Selective saves the outputs of
the dense matmuls, attention, the KDA kernel and the DSA indexer's tiled ops (selection, KL with its precomputed
gradient), and recomputes the cheap elementwise ops (norms, gates, mHC maps) and the routed experts (their grouped
GEMMs, BF16 or FP8, and SwiGLU, from the kept block input): the experts' rows are top-k times the tokens, the
largest activations of a MoE block for one grouped forward of compute.

recompute_modules (selective only) recomputes the saved ops of the listed parts of each block as well:
  kda          the whole KDA token mixer (projections, short convs, gates, the kernel, gated norm): only its input
               is kept (the Megatron PR's recompute of the KDA block)
  mhc          the mHC maps' projection and the stream mixing (HyperConnection, its merge included)
  indexer      the DSA indexer: its projections, pooled keys, top-k selection and KL (re-run in backward)
  mla_up_proj  the MLA query / key-value up-projections (q_b_proj, kv_b_proj)
  sparse_attn  the DSA attention kernel (sparse absorbed MLA; the dense stage's masked attention)
  moe          the MoE layer: router and shared expert too (the routed experts are recomputed by selective)
  mlp          the dense layers' MLP
moe_chunk_tokens (any mode) runs the routed experts over checkpointed token chunks, so one chunk's expert
activations are alive at a time in backward: for long sequences, at the cost of one more expert forward (on top of
the one full or selective AC already re-runs: the block's recompute runs the chunks, and each chunk's backward runs
its chunk again).
The decision is taken per op (the same `torch.utils.checkpoint` policy machinery as selective) from where the op
runs: the Python code regions (class methods) on its call stack, and for mla_up_proj the module being called. In
eager those come from the interpreter's frames; under torch.compile the policy runs while AOTAutograd traces the
block, and they come from the FX node's recorded `stack_trace` and `nn_module_stack` (torch's
`fx.traceback.get_current_meta`), so a fullgraph-compiled block takes the same decisions.
"""

from __future__ import annotations

import functools
import re
import sys
from types import CodeType
from typing import Iterable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
RECOMPUTE_MODULES = ("kda", "mhc", "indexer", "mla_up_proj", "sparse_attn", "moe", "mlp")
# Megatron names that plain selective already does: accepted (a Megatron config carries over) and change nothing.
IMPLIED_BY_SELECTIVE = {
    "moe_act": "selective already recomputes the routed experts, their SwiGLU activation and grouped GEMMs; "
               "'moe' recomputes the router and the shared expert too",
}


def _save_list() -> set:
    ops = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._flash_attention_forward.default,
    }
    # The routed experts' grouped GEMMs are recomputed (module docstring): BF16 they run inside our custom op
    # (torchtitan_glm::grouped_mm, not listed); FP8 torchao's autograd function runs aten._scaled_grouped_mm,
    # left out here for the same choice.
    if hasattr(torch.ops.aten, "_scaled_mm"):
        ops.add(torch.ops.aten._scaled_mm.default)
    for name in ("kda_fwd", "kda_cp_fwd", "sparse_mla_fwd", "kpool_topk", "indexer_kl_sparse", "indexer_kl_dense"):
        if hasattr(torch.ops, "torchtitan_glm") and hasattr(torch.ops.torchtitan_glm, name):
            ops.add(getattr(torch.ops.torchtitan_glm, name).default)
    return ops


# ---------------------------------------------------------------------------------------- where an op runs
def _codes(*owners: object) -> set[CodeType]:
    """The code objects of the functions defined in classes (their own methods) or given as functions."""
    out: set[CodeType] = set()
    for owner in owners:
        members = vars(owner).values() if isinstance(owner, type) else [owner]
        for f in members:
            f = getattr(f, "__func__", f)
            if callable(f) and hasattr(f, "__code__"):
                out.add(f.__code__)
    return out


def _span(code: CodeType) -> tuple[str, str, int, int]:
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return code.co_filename, code.co_name, min(lines + [code.co_firstlineno]), max(lines + [code.co_firstlineno])


_TRACE_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class BlockSites:
    """Which recompute_modules label covers an op of the given blocks, from where it runs (see the module docstring).

    One object serves every block of a model: torch.compile guards on its identity (it is an argument of the
    checkpoint's context_fn), so an object per block made each block a recompile, and a model of more than 8 blocks
    passed dynamo's recompile limit, a hard error under fullgraph (the proxy, 2026-12-06)."""

    def __init__(self, blocks: Iterable[nn.Module], names: Iterable[str]) -> None:
        from torchtitan_glm.models.glm5.dsa import KPoolIndexer, SparseMLA
        from torchtitan_glm.models.glm5.kda import KimiDeltaAttention
        from torchtitan_glm.models.glm5.layers import DenseMLP
        from torchtitan_glm.models.glm5.mhc import HyperConnection
        from torchtitan_glm.models.glm5.moe import MoE
        from torchtitan_glm.ops.masked_attention import masked_attention
        from torchtitan_glm.ops.sparse_mla import sparse_mla

        self.names = tuple(n for n in names if n not in IMPLIED_BY_SELECTIVE)
        unknown = set(self.names) - set(RECOMPUTE_MODULES)
        if unknown:
            raise ValueError(f"unknown recompute_modules {sorted(unknown)}; choose from {list(RECOMPUTE_MODULES)}")
        # code regions: an op is inside one when a frame of one of these functions is on its call stack
        self.codes = {"kda": _codes(KimiDeltaAttention), "mhc": _codes(HyperConnection),
                      "indexer": _codes(KPoolIndexer, SparseMLA._indexer_kl), "moe": _codes(MoE),
                      "mlp": _codes(DenseMLP), "sparse_attn": _codes(masked_attention, sparse_mla)}
        self.spans = {n: [_span(c) for c in codes] for n, codes in self.codes.items()}
        # mla_up_proj: the up-projection modules themselves (whatever Linear class float8 made them)
        blocks = list(blocks)
        attn = [m for block in blocks for m in block.modules() if isinstance(m, SparseMLA)]
        self.up_proj = {id(getattr(a, n)): getattr(a, n) for a in attn for n in ("q_b_proj", "kv_b_proj")}
        self.up_proj_codes = {type(m).forward.__code__ for m in self.up_proj.values()}
        self.block_codes = set().union(*(_codes(type(block)) for block in blocks))
        self.seen: dict[str, int] = {}  # ops recomputed per label (traced ops, under compile)

    def recompute(self, op) -> bool:
        """Whether one of the chosen labels covers this op."""
        label = self._label()
        if label is not None:
            self.seen[label] = self.seen.get(label, 0) + 1
        return label is not None

    def _label(self) -> str | None:
        meta = torch.fx.traceback.get_current_meta() or {}
        if meta.get("stack_trace"):  # traced by torch.compile: the node's recorded user frames and modules
            frames = [(f, n, int(line)) for f, line, n in _TRACE_FRAME.findall(meta["stack_trace"])]
            modules = {int(k) for k in (meta.get("nn_module_stack") or {}) if str(k).isdigit()}

            def inside(label: str) -> bool:
                return any(f == sf and n == sn and lo <= line <= hi
                           for f, n, line in frames for sf, sn, lo, hi in self.spans[label])
        else:
            codes, modules = self._python_frames()

            def inside(label: str) -> bool:
                return not codes.isdisjoint(self.codes[label])
        for name in self.names:
            if name == "mla_up_proj":
                if modules & self.up_proj.keys():
                    return name
            elif name == "mlp":
                if inside("mlp") and not inside("moe"):  # the dense layers' MLP, not the shared expert
                    return name
            elif inside(name):
                return name
        return None

    def _python_frames(self) -> tuple[set[CodeType], set[int]]:
        """Eager: the code objects on the interpreter's stack, and the up-projection modules being called."""
        codes: set[CodeType] = set()
        modules: set[int] = set()
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            codes.add(code)
            if code in self.up_proj_codes and id(frame.f_locals.get("self")) in self.up_proj:
                modules.add(id(frame.f_locals["self"]))
            frame = frame.f_back
        if codes.isdisjoint(self.block_codes):
            raise RuntimeError("activation_checkpoint.recompute_modules: an op of the block ran with neither node "
                               "metadata (torch.compile) nor the block's forward on the Python stack; cannot tell "
                               "which module it belongs to")
        return codes, modules


def _policy(save: set, sites: BlockSites | None, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op not in save:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if sites is not None and sites.recompute(op):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _selective_context(sites: BlockSites | None = None) -> tuple:
    return create_selective_checkpoint_contexts(functools.partial(_policy, _save_list(), sites))


def _recompute_all(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _full_context() -> tuple:
    return create_selective_checkpoint_contexts(_recompute_all)


def for_compile(layer: nn.Module) -> nn.Module:
    """The layer compile.py compiles in place of `layer`: a full-AC layer is re-wrapped so its checkpoint names
    "recompute" for every op (a selective policy that saves nothing), other layers are returned as they are.

    A plain checkpoint traced by dynamo is tagged for recompute node by node in dynamo's graph, and torch 2.11 does not
    tag the ops inside autograd.Functions there (the mHC projection, the KDA gate, the gated norm, the MoE dispatch,
    SwiGLU); the min-cut partitioner saved their outputs as if there were no checkpoint: about 30 GiB for the proxy
    at T = 32,768, which then ran out of memory on an H100 where eager full AC peaks at 53.8 GiB (docs/performance.md,
    thirty-first session). A selective policy tags every op as AOTAutograd traces it, inside autograd.Functions too,
    on torch 2.11 and 2.13 alike. Eager keeps the plain checkpoint: the policy's dispatch mode would cost every op a
    Python call. (An eager checkpoint around the compiled block saved the inputs only, but on torch 2.11 its
    recompute recompiled every block kind: a dispatch-key guard on the inputs the checkpoint hands back.)"""
    if getattr(layer, "ac_mode", None) != "full":
        return layer
    wrapped = checkpoint_wrapper(layer._checkpoint_wrapped_module, preserve_rng_state=False, context_fn=_full_context)
    wrapped.ac_mode = "full"
    return wrapped


def wrap_block(block: nn.Module, *, mode: str, recompute_modules: Iterable[str] = (),
               sites: BlockSites | None = None) -> nn.Module:
    """The block wrapped for `mode` (checkpoint_wrapper keeps state_dict names free of its prefix). sites: the
    model's shared BlockSites for recompute_modules (default: one for this block alone)."""
    recompute_modules = tuple(recompute_modules)
    if recompute_modules and mode != "selective":
        raise ValueError(f"recompute_modules {list(recompute_modules)} refine activation_checkpoint.mode "
                         f"'selective', not {mode!r}")
    if mode == "none":
        return block
    if mode == "full":
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        wrapped.ac_mode = "full"  # for_compile swaps in the op-by-op form before torch.compile
        return wrapped
    if mode == "selective":
        sites = (sites or BlockSites([block], recompute_modules)) if recompute_modules else None
        wrapped = checkpoint_wrapper(block, preserve_rng_state=False,
                                     context_fn=functools.partial(_selective_context, sites))
        wrapped.recompute_sites = sites
        return wrapped
    raise ValueError(f"activation_checkpoint.mode must be one of {MODES}, got {mode!r}")


class HostOffload:
    """Saved-tensor hooks that keep what a full-AC block saves for backward (its inputs: the mHC streams, a shared
    layer's token indices) in pinned host memory, copied back when backward recomputes the block.

    torch.autograd.graph.save_on_cpu does the same with a blocking device-to-host copy (a host sync per block). Here
    the device-to-host copy runs on a side stream, after the work that produced the tensor, overlapping the next
    block's compute (record_stream keeps the tensor's memory from reuse until the copy is done); the copy back is
    non-blocking on the current stream, and the pinned host allocator keeps the host buffer until it is done.
    Parameters pass through (FSDP2 re-gathers them). copy_host_tensors: copy host tensors too (CPU tests of the
    round trip); `offloaded_bytes` counts the copies."""

    def __init__(self, *, copy_host_tensors: bool = False) -> None:
        self.copy_host_tensors = copy_host_tensors
        self.offloaded_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or not t.numel() or (t.device.type == "cpu" and not self.copy_host_tensors):
            return t  # an empty tensor (torch 2.11's checkpoint saves one beside the inputs) has nothing to move
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
        copied = None
        if t.device.type == "cuda":
            stream = self._streams.setdefault(t.device, torch.cuda.Stream(t.device))
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            t.record_stream(stream)
        else:
            host.copy_(t)
        self.offloaded_bytes += host.numel() * host.element_size()
        return t.device, host, copied

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, copied = packed
        if copied is not None:  # the copy back starts after the copy out has ended
            torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=True)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A fresh context for one block call."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def offload_host_bytes(args, *, tokens: int, act_bytes: int, mtp: bool) -> int:
    """Pinned host bytes one rank holds at the turn of a step under offload_inputs: every decoder layer's
    [tokens, hc_mult, hidden] streams and each MTP layer's two [tokens, hidden] inputs, in the activations' dtype
    (the int64 document inputs, 16-24 bytes a token, aside). The planner counts the same (memory.host_pinned)."""
    streams = args.num_hidden_layers * args.hc_mult * args.hidden_size
    return tokens * act_bytes * (streams + (2 * args.hidden_size * args.num_nextn_predict_layers if mtp else 0))


def apply_activation_checkpointing(model: nn.Module, *, mode: str, recompute_modules: Iterable[str] = (),
                                   moe_chunk_tokens: int = 0, offload_inputs: bool = False,
                                   kda_disable_recompute: bool = False) -> None:
    """Wrap every decoder layer and the MTP layer of a Glm5Model in place. moe_chunk_tokens > 0 runs every MoE's
    routed experts over checkpointed token chunks of that many tokens (models/glm5/moe.py::MoE), in any mode.
    offload_inputs (full only): the blocks' saved inputs wait for backward in host memory (HostOffload).
    kda_disable_recompute (any mode): every KDA op keeps FLA's forward intermediates for its backward
    (models/glm5/kda.py, save_states)."""
    from torchtitan_glm.models.glm5.kda import KimiDeltaAttention
    from torchtitan_glm.models.glm5.moe import MoE

    if moe_chunk_tokens < 0:
        raise ValueError(f"activation_checkpoint.moe_chunk_tokens must be >= 0, got {moe_chunk_tokens}")
    if offload_inputs and mode != "full":
        raise ValueError(f"activation_checkpoint.offload_inputs needs mode 'full' (what a full-AC block saves is its "
                         f"inputs), not {mode!r}")
    model.block_offload = HostOffload() if offload_inputs else None
    for m in model.modules():
        if isinstance(m, MoE):
            m.chunk_tokens = moe_chunk_tokens
        elif isinstance(m, KimiDeltaAttention):
            m.save_states = kda_disable_recompute
    recompute_modules = tuple(recompute_modules)
    mtp = getattr(model, "mtp", None)
    blocks = list(model.layers.values()) + ([mtp] if mtp is not None else [])
    sites = BlockSites(blocks, recompute_modules) if recompute_modules and mode == "selective" else None
    for name, layer in list(model.layers.items()):
        model.layers[name] = wrap_block(layer, mode=mode, recompute_modules=recompute_modules, sites=sites)
    if mtp is not None:
        model.mtp = wrap_block(mtp, mode=mode, recompute_modules=recompute_modules, sites=sites)
