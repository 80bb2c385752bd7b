"""Python logging for the trainer, and the rank-0 start-up summary (what the run is about to do, in one block)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Sequence

import torch
from torch import nn

__all__ = [
    "drop_benign_warnings", "init_logging", "format_block", "format_count", "format_bytes", "precision_line",
    "local_shard", "memory_per_rank", "device_memory", "loss_buffers", "data_line", "startup_summary",
]

_PACKAGE = "torchtitan_glm"
logger = logging.getLogger(__name__)


# Warnings from other libraries that every FP8 or low-bit-optimizer run printed and that concern nothing the trainer
# does (an outside review read them as errors): torchao's prebuilt C++ extensions (its MXFP8 and CUTLASS kernels,
# which the trainer never calls: its FP8 runs torchao's Python and Triton code and torch._scaled_grouped_mm) failing
# to load against this torch build, and torch's note to torchao that registering its enums as pytree constants is
# deprecated. (logger, fragments a message must all contain); anything else those loggers say still prints.
_BENIGN_WARNINGS = (("torchao", ("Failed to load ", "_C")),
                    ("torch.utils._pytree", ("is an Enum subclass", "register_constant")))


class _DropBenign(logging.Filter):
    """Drops one logger's records whose message contains every one of `fragments`."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not all(f in str(record.msg) for f in self.fragments)


def drop_benign_warnings() -> None:
    """Filter the known-benign third-party warnings above out of their loggers (before those libraries are
    imported: torchao warns at import). Idempotent; the scripts that import torchao call it too."""
    for name, fragments in _BENIGN_WARNINGS:
        other = logging.getLogger(name)
        if not any(isinstance(f, _DropBenign) for f in other.filters):
            other.addFilter(_DropBenign(fragments))


def init_logging(*, rank: int) -> None:
    """The package's loggers print to stdout: INFO and up on rank 0, WARNING and up (prefixed by the rank)
    elsewhere, so a multi-rank job logs once; the known-benign third-party warnings above are dropped. Idempotent;
    the root logger is left alone."""
    drop_benign_warnings()
    log = logging.getLogger(_PACKAGE)
    for h in list(log.handlers):
        if getattr(h, "_torchtitan_glm", False):
            log.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler._torchtitan_glm = True  # type: ignore[attr-defined]
    prefix = "" if rank == 0 else f"[rank{rank}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def format_block(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """A titled block of aligned `name  value` rows."""
    width = max(len(name) for name, _ in rows)
    return "\n".join([title] + [f"  {name.ljust(width)}  {value}" for name, value in rows])


def format_count(n: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_bytes(n: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


_SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def precision_line(training: Any, float8: Any = None, *, expert_modules: tuple[int, int] | None = None) -> str:
    """How parameters are computed and gradients reduced (the [training] mixed-precision keys), and the FP8 split
    ([float8]: recipe, routed experts, roles kept BF16) when it is on. `expert_modules`: (routed-expert modules in
    FP8, all of them) in the converted model (None: as float8.moe_experts says)."""
    param = _SHORT_DTYPE.get(training.mixed_precision_param, training.mixed_precision_param)
    reduce = _SHORT_DTYPE.get(training.mixed_precision_reduce, training.mixed_precision_reduce)
    line = f"{param} params, {reduce} reduce"
    if float8 is not None and float8.enable:
        fp8, total = expert_modules if expert_modules is not None else (int(float8.moe_experts), 1)
        if total == 0:
            experts = "no routed experts"
        elif not float8.moe_experts:
            experts = "BF16 experts"
        elif fp8 == 0:
            experts = "BF16 experts (float8.moe_experts, but no expert weight has dims divisible by 16)"
        else:
            experts = "FP8 grouped experts" + (f" ({fp8} of {total} modules)" if fp8 < total else "")
        line += (f"; FP8 {float8.recipe} Linears, {experts}, kept BF16: {', '.join(float8.keep_bf16) or 'nothing'}"
                 f"{', FP8 all-gather' if float8.fsdp_float8_all_gather else ''}")
    return line


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, unwrapped from torchao's FP8 all-gather wrapper."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local._tensor if type(local) is not torch.Tensor and hasattr(local, "_tensor") else local


def memory_per_rank(model: nn.Module, *, optimizer: Any = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer states, from its local shards; the states as
    the [optimizer] section stores them (`optimizer`: an OptimizerConfig; None: AdamW's two states per trainable
    parameter in its dtype). Activations and gathered weights are not counted."""
    from torchtitan_glm.components.optimizer import optimizer_state_bytes

    params = grads = 0
    for p in model.parameters():
        local = local_shard(p)
        nbytes = local.numel() * local.element_size()
        params += nbytes
        if p.requires_grad:
            grads += nbytes
    states = 2 * grads if optimizer is None else optimizer_state_bytes(model, optimizer)
    return {"params": params, "grads": grads, "optimizer": states}


def device_memory(device: torch.device) -> int | None:
    """Total bytes of a CUDA device; None elsewhere (host memory is not checked)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def host_available_memory() -> int | None:
    """Bytes of host memory the kernel says can be allocated without swapping (Linux MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def loss_buffers(*, tokens: int, vocab: int, dim: int, chunk: int, weight_bytes: int,
                 compiled: bool = False) -> dict[str, int]:
    """Bytes the fused LM-head cross-entropy (ops/linear_cross_entropy.py) holds for `tokens` rows (trunk + MTP):
    one chunk's logits with their softmax gradient in the weight's dtype while it runs (eager: the logits in FP32;
    compiled: in the weight's dtype, the upcast fused), and the weight gradient it keeps from forward to backward:
    FP32 when it sums several chunks, in the weight's dtype for one."""
    rows = min(tokens, chunk)
    several = tokens > chunk
    return {"logits_chunk": rows * vocab * ((weight_bytes if compiled else 4) + weight_bytes),
            "weight_grad": vocab * dim * (4 if several else weight_bytes), "fp32_weight_grad": int(several)}


def _model_line(cfg: Any, args: Any) -> str:
    source = f"hf_config {cfg.model.hf_config}" if cfg.model.hf_config else (
        f"HF checkpoint {cfg.checkpoint.initial_load_path}" if cfg.checkpoint.initial_load_in_hf
        else f"flavor {cfg.model.flavor!r}")
    n_kda = sum(t == "linear_attention" for t in args.layer_types)
    n_moe = sum(t != "dense" for t in args.mlp_layer_types)
    return (f"{cfg.model.name} ({source}): {args.num_hidden_layers} layers ({n_kda} KDA + "
            f"{args.num_hidden_layers - n_kda} DSA, {n_moe} MoE of {args.n_routed_experts} experts, top "
            f"{args.num_experts_per_tok}), MTP {args.num_nextn_predict_layers}, vocab {args.vocab_size}")


def compute_line(cfg: Any) -> str:
    """torch.compile and activation checkpointing as configured: what sets the step's speed and activation memory."""
    c, ac = cfg.compile, cfg.activation_checkpoint
    compiled = f"torch.compile {c.backend} ({', '.join(c.components)})" if c.enable else "eager (compile.enable false)"
    parts = [f"activation checkpointing {ac.mode}"]
    if ac.recompute_modules:
        parts.append(f"recompute_modules {', '.join(ac.recompute_modules)}")
    if ac.moe_chunk_tokens:
        parts.append(f"routed experts in checkpointed chunks of {ac.moe_chunk_tokens:,} tokens")
    if ac.offload_inputs:
        parts.append("saved block inputs in pinned host memory")
    if ac.kda_disable_recompute:
        parts.append("KDA kernel intermediates kept for backward (FLA disable_recompute)")
    return f"{compiled}; " + ", ".join(parts)


def data_line(data: dict[str, Any], *, steps: int, global_batch_rows: int) -> tuple[str, str | None]:
    """The summary's data row from PackedDataLoader.summary() (source, files, documents, tokens, rows per epoch,
    document masking) and how many epochs `steps` global batches of `global_batch_rows` rows cover, so that
    repeated data is seen before training; and a warning (None if not) when one global batch holds more rows than
    an epoch."""
    files = data["files"]
    names = ", ".join(files[:3]) + (f", ... ({len(files)} files)" if len(files) > 3 else "")
    where = f"{len(files)} standard-library files" if data["source"] == "builtin" else names
    rows = data["rows_per_epoch"]
    rows_text = f"{rows:,}" if isinstance(rows, int) else f"{rows:,.1f}"
    epochs = steps * global_batch_rows / rows
    line = (f"{data['source']} ({where}): {data['documents']:,} documents, {format_count(data['tokens'])} tokens, "
            f"{rows_text} rows of {data['row_len']} tokens per epoch; {steps} steps x {global_batch_rows} rows = "
            f"{epochs:.3g} epochs")
    if not data.get("document_masking", True):
        line += "; each row one causal sequence (data.document_masking false)"
    warning = None
    if global_batch_rows > rows:
        warning = (f"one global batch ({global_batch_rows} rows of {data['row_len']} tokens) holds more rows than an "
                   f"epoch of the data ({rows_text}): every step repeats rows, {epochs:.3g} epochs in "
                   f"{steps} steps; add data (data.paths) or lower training.local_batch_size / "
                   "training.global_batch_size")
    return line, warning


def startup_summary(*, cfg: Any, args: Any, model: nn.Module, world: int, dp_size: int, device: torch.device,
                    resume: str, layout: str = "", device_bytes: int | None = None, host_pinned: int = 0,
                    planned: str | None = None, planned_speed: str | None = None, dataloader: Any = None) -> str:
    """The block rank 0 logs before the first step: model, parameters, layout, precision, memory per rank,
    tokens per step, where outputs go, and whether the run resumes. `device_bytes` (the accelerator's memory): a
    "fits" row saying when parameters, gradients and optimizer states alone already exceed it. `host_pinned`: the
    host bytes activation_checkpoint.offload_inputs pins per rank (a row when > 0). `planned`, `planned_speed`: the
    planner's peak (activations included) and step time, rows when given. `dataloader` (a PackedDataLoader): a
    data row (data_line), and a WARNING logged when one global batch holds more rows than an epoch."""
    from torchtitan_glm.components.metrics import count_params
    from torchtitan_glm.models.glm5.moe import GroupedExperts

    counts = count_params(args)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    mem = memory_per_rank(model, optimizer=cfg.optimizer)
    rows_per_rank = cfg.training.seq_len * cfg.training.local_batch_size
    head_tokens = rows_per_rank * (2 if args.num_nextn_predict_layers and cfg.loss.mtp_weight > 0 else 1)
    weight_bytes = 2 if cfg.training.mixed_precision_param == "bfloat16" else 4
    ce = loss_buffers(tokens=head_tokens, vocab=args.vocab_size, dim=args.hidden_size, chunk=cfg.loss.ce_chunk_size,
                      weight_bytes=weight_bytes, compiled=cfg.compile.enable and "loss" in cfg.compile.components)
    opt = cfg.optimizer
    where = "; params, grads and optimizer in host memory (optimizer.cpu_offload)" if opt.cpu_offload else ""
    from torchtitan_glm.components.optimizer import resolved_implementation

    step_impl = resolved_implementation(opt, on_cuda=device.type == "cuda" and not opt.cpu_offload)
    backend = "nccl" if device.type == "cuda" else "gloo"
    micro = cfg.training.accumulation_steps(dp_size)
    tokens = cfg.training.tokens_per_step(dp_size)
    if dataloader is not None:
        data_row, repeats = data_line(dataloader.summary(), steps=cfg.training.steps,
                                      global_batch_rows=dataloader.global_batch_rows * micro)
        if repeats:
            logger.warning(repeats)
    ck = cfg.checkpoint
    saving = "async" if ck.async_mode == "async" else "synchronous"
    checkpoints = (f"{os.path.join(cfg.job.dump_folder, ck.folder)} (every {ck.interval} steps, keep "
                   f"{ck.keep_latest_k or 'all'}, {saving})" if ck.enable else "off")
    tensorboard = (os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
                   if cfg.metrics.enable_tensorboard else "off")
    rows = [
        ("model", _model_line(cfg, args)),
        ("parameters", f"{format_count(counts.total)} total, {format_count(counts.active)} active per token"),
        ("layout", f"{world} rank(s), {backend} on {device.type}: " + (
            layout or f"FSDP2 data_parallel_shard={dp_size}")),
        ("precision", precision_line(cfg.training, cfg.float8, expert_modules=(
            sum(m.fp8 for m in experts), len(experts)))),
        ("compute", compute_line(cfg)),
        ("memory/rank", f"params {format_bytes(mem['params'])}, grads {format_bytes(mem['grads'])}, optimizer "
                        f"{format_bytes(mem['optimizer'])} ({opt.name}, {step_impl} step; sharded state{where}); "
                        "activations not included" + ("; planned below" if planned else "")),
        *([("planned peak", planned)] if planned else []),
        *([("planned speed", planned_speed)] if planned_speed else []),
        *([("host offload", f"{format_bytes(host_pinned)} pinned host memory per rank for the checkpointed blocks' "
                             "inputs (activation_checkpoint.offload_inputs)")] if host_pinned else []),
        ("loss buffers", f"{format_bytes(ce['logits_chunk'])} logits chunk, "
                         f"{format_bytes(ce['weight_grad'])} LM-head weight gradient "
                         + (f"(FP32: {head_tokens:,} rows > loss.ce_chunk_size {cfg.loss.ce_chunk_size:,})"
                            if ce["fp32_weight_grad"] else "(one chunk: in the weight's dtype)")),
        ("tokens/step", f"{tokens:,} (seq_len {cfg.training.seq_len} x local_batch_size "
                        f"{cfg.training.local_batch_size} x {dp_size} data-parallel"
                        + (f" x {micro} microbatches accumulated: training.global_batch_size "
                           f"{cfg.training.global_batch_size} rows)" if micro > 1 else ")")),
        ("steps", f"{cfg.training.steps} (on non-finite loss: {cfg.training.on_nonfinite})"),
        *([("data", data_row)] if dataloader is not None else []),
        ("dump folder", cfg.job.dump_folder),
        ("tensorboard", tensorboard),
        ("checkpoints", checkpoints),
        ("resume", resume),
    ]
    state = 0 if opt.cpu_offload else sum(mem.values())
    if device_bytes is not None and state > device_bytes:
        rows.insert(5, ("fits", f"NO: params + grads + optimizer are {format_bytes(state)} per rank, the device has "
                                f"{format_bytes(device_bytes)}; the first step will run out of memory "
                                "(scripts/plan.py --search finds a layout that fits)"))
    return format_block("run summary", rows)
