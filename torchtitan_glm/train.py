"""The Trainer: check the inputs, build (mesh, model, FSDP2/compile/AC, optimizer, checkpoints), resume, then the
training loop with its non-finite guard and graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_glm.activation_checkpoint import offload_host_bytes
from torchtitan_glm.components import loss as losses
from torchtitan_glm.components.checkpoint import (CheckpointManager, hf_export_dir, list_checkpoints,
                                                  list_hf_exports, step_dir)
from torchtitan_glm.components.cuda_alloc import default_alloc_conf, limit_device_memory, memory_limit_error
from torchtitan_glm.components.data import build_dataloader
from torchtitan_glm.components.errors import (CheckpointError, NonFiniteError, ResumeMismatchError, is_expected,
                                              one_line, run_job)
from torchtitan_glm.components.logs import (device_memory, format_bytes, host_available_memory, init_logging,
                                           startup_summary)
from torchtitan_glm.components.lr_scheduler import build_lr_scheduler
from torchtitan_glm.components.metrics import (
    DeviceMemoryMonitor, build_metrics_logger, flops_per_token, format_step_line, get_peak_flops, throughput,
)
from torchtitan_glm.components.optimizer import build_optimizer, clip_grad_norm_, resolved_implementation
from torchtitan_glm.components.outputs import check_output_folders
from torchtitan_glm.components.profiling import StepProfiler
from torchtitan_glm.components.resume import (layout_note, optimizer_changes, optimizer_note, precision_changes,
                                              precision_note, resume_mismatches, run_info, schedule_note)
from torchtitan_glm.components.signals import StopRequest
from torchtitan_glm.components.step_stats import PendingStep, StepStats, optimizer_step, supports_device_skip
from torchtitan_glm.components.tokenizer import build_tokenizer, check_vocab_fits
from torchtitan_glm.config import ConfigError, JobConfig, load_config, main_guard
from torchtitan_glm.distributed.cp_layout import CPLayout
from torchtitan_glm.distributed.fsdp_comms import (compute_pool_applies, compute_pool_wanted,
                                                   custom_reduce_scatter_supported)
from torchtitan_glm.distributed.grad_accumulation import GradientAccumulation
from torchtitan_glm.distributed.parallel_dims import ParallelDims, validate_model_layout, world_size_from_env
from torchtitan_glm.float8 import check_float8_on_cpu, configure_inductor_for_float8, convert_float8, \
    precompute_float8_scales
from torchtitan_glm.models.glm5 import Glm5Model, Glm5ModelArgs
from torchtitan_glm.models.glm5.batch import TrainBatch, train_batch
from torchtitan_glm.models.glm5.parallelize import parallelize_glm5

logger = logging.getLogger(__name__)

# Models up to this size are initialised whole on every rank before sharding, which makes the initial weights
# independent of the world size; larger ones are built on meta and initialised shard by shard.
_MATERIALIZE_INIT_MAX_PARAMS = 2_000_000_000
_DOCS_IN_MESSAGE = 5  # documents named in a non-finite error line (all of them go to a file)


def build_model_args(cfg: JobConfig) -> Glm5ModelArgs:
    """From model.hf_config, else the HF checkpoint being loaded, else the named flavor; then the [model] overrides."""
    if not cfg.model.hf_config and cfg.checkpoint.initial_load_in_hf and cfg.checkpoint.initial_load_path:
        args = Glm5ModelArgs.from_hf_config(cfg.checkpoint.initial_load_path, **cfg.model.args)
    else:
        args = cfg.model.model_args()
    stage = "dense" if cfg.loss.indexer_stage == "dense_warmup" else "sparse"
    if cfg.loss.mtp_weight == 0:
        args = args.replace(num_nextn_predict_layers=0)
    return args.replace(dsa_attention=stage, indexer_tile_elements=cfg.loss.indexer_tile_elements)


def _model_source(cfg: JobConfig) -> str:
    if "vocab_size" in cfg.model.args:
        return "model.vocab_size"
    if cfg.model.hf_config:
        return f"model.hf_config {cfg.model.hf_config}"
    if cfg.checkpoint.initial_load_in_hf and cfg.checkpoint.initial_load_path:
        return f"the HF config of checkpoint.initial_load_path {cfg.checkpoint.initial_load_path}"
    return f"model.flavor {cfg.model.flavor!r}"


class _SkippedSteps(Stateful):
    """Steps whose update training.on_nonfinite='skip' dropped: in all, and in a row (saved with checkpoints)."""

    def __init__(self) -> None:
        self.total, self.in_a_row = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total, self.in_a_row = int(state_dict["total"]), int(state_dict["in_a_row"])


def _free_port() -> int:
    """A TCP port free on this host now, for the one process of a run started without torchrun."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(*, cpu_backend: bool = False) -> tuple[int, int, torch.device]:
    """Join the torchrun process group (NCCL on GPU, gloo on CPU); a plain `python train.py` is a world of one.
    cpu_backend: on GPU, gloo too for CPU tensors (optimizer.cpu_offload: the gradient norm of host gradients)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # `python train.py`: a free port, not a fixed one another job may hold
        os.environ["MASTER_PORT"] = str(_free_port()) if world == 1 else "29500"
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if cpu_backend else "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return rank, world, device


def check_layout(cfg: JobConfig) -> tuple[ParallelDims, Glm5ModelArgs]:
    """The parallel layout checked against WORLD_SIZE (torchrun sets it before Python starts) and the model args,
    profiling.memory against the host (CUDA only), and on a GPU host the pinned memory of
    activation_checkpoint.offload_inputs against the host's: ConfigErrors naming the keys, raised before any
    process group starts (main() runs it first: exit 2)."""
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size=world_size_from_env())
        args = build_model_args(cfg)
        validate_model_layout(dims, args, seq_len=cfg.training.seq_len, expert_fsdp=cfg.parallelism.expert_fsdp)
        cfg.training.accumulation_steps(dims.dp)
        if cfg.parallelism.fsdp_reduce_in_compute_pool and not compute_pool_applies(
                splits_parameters=dims.splits_parameters, cpu_offload=cfg.optimizer.cpu_offload):
            raise ConfigError("parallelism.fsdp_reduce_in_compute_pool",
                              f"applies where no parameter is split over ranks and FSDP2's reduce is a copy; this "
                              f"layout has data_parallel_shard {dims.dp_shard} x context_parallel {dims.cp}, tensor "
                              f"parallel {dims.tp}, expert parallel {dims.ep}"
                              + (", and optimizer.cpu_offload" if cfg.optimizer.cpu_offload else "")
                              + "; leave it unset to have it wherever it applies")
        if cfg.parallelism.fsdp_reduce_in_compute_pool and not custom_reduce_scatter_supported():
            raise ConfigError("parallelism.fsdp_reduce_in_compute_pool",
                              f"needs FSDP2's set_custom_reduce_scatter, which torch {torch.__version__} lacks")
        if cfg.profiling.memory and not torch.cuda.is_available():
            raise ConfigError("profiling.memory", "records CUDA allocations (torch.cuda.memory) and this host has "
                              "no CUDA device; use profiling.enable for the operator profile")
        if torch.cuda.is_available():
            check_offload_host_memory(cfg, args, cp=dims.cp,
                                      local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                      available=host_available_memory())
    except ConfigError as e:
        raise cfg.with_source(e) from None
    return dims, args


def check_this_host(cfg: JobConfig) -> None:
    """training.device_memory_limit_gib against this host's device, and a rowwise float8.recipe against a CPU
    host's torch (not in check_layout: the planner checks configs for machines it is not on); a ConfigError naming
    the key."""
    if not torch.cuda.is_available():
        try:
            check_float8_on_cpu(cfg.float8)
        except ConfigError as e:
            raise cfg.with_source(e) from None
    limit = cfg.training.device_memory_limit_gib
    if limit:
        card = (torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory
                if torch.cuda.is_available() else None)
        why = memory_limit_error(limit, total_bytes=card)
        if why:
            raise cfg.with_source(ConfigError("training.device_memory_limit_gib", why))


def offload_pinned_bytes(cfg: JobConfig, args: Glm5ModelArgs, *, cp: int) -> int:
    """Pinned host bytes per rank under activation_checkpoint.offload_inputs (0 when off)."""
    if not cfg.activation_checkpoint.offload_inputs:
        return 0
    tr = cfg.training
    return offload_host_bytes(args, tokens=tr.local_batch_size * tr.seq_len // cp,
                              act_bytes=2 if tr.mixed_precision_param == "bfloat16" else 4,
                              mtp=args.num_nextn_predict_layers > 0 and cfg.loss.mtp_weight > 0)


def check_offload_host_memory(cfg: JobConfig, args: Glm5ModelArgs, *, cp: int, local_ranks: int,
                              available: int | None) -> None:
    """offload_inputs pins the checkpointed blocks' inputs in host memory. When this host's ranks would pin more
    than 90% of what it has available, stop now (exit 2) rather than have the kernel's OOM killer end the job in
    its first step (a SIGKILL: no error line, no checkpoint)."""
    need = offload_pinned_bytes(cfg, args, cp=cp)
    if need and available is not None and need * local_ranks > 0.9 * available:
        gib = 2**30
        raise ConfigError("activation_checkpoint.offload_inputs",
                          f"each rank pins {need / gib:.1f} GiB of host memory for its blocks' inputs "
                          f"(training.seq_len {cfg.training.seq_len} x local_batch_size "
                          f"{cfg.training.local_batch_size} / context_parallel_degree {cp}), {local_ranks} rank(s) on "
                          f"this host {need * local_ranks / gib:.1f} GiB, and the host has {available / gib:.1f} "
                          "GiB available (MemAvailable); turn it off, or shorten the rows or raise "
                          "context_parallel_degree")


def planned_rows(argv: list[str] | None, *, gpus: int, device_bytes: int | None,
                 device_name: str = "") -> tuple[str | None, str | None]:
    """The planner's figures for this run (scripts/plan.py on the same arguments), for the start-up summary: (the
    allocated peak with its parts against the device's memory, the step time and tokens/s). Without a GPU
    (device_bytes None) the activations and the peak alone: the planner's saved-tensor inventories are the ones its
    tests capture on CPU, its times are of CUDA kernels. None without arguments; the speed only on an H200, whose
    kernel rates the planner holds. A plan the planner cannot make says why instead (it never stops the run)."""
    if argv is None:
        return None, None
    from torchtitan_glm.planner import Request, get_gpu, plan
    from torchtitan_glm.planner.hardware import GIB

    gpu = get_gpu("h200") if device_bytes is None else get_gpu("h200", memory_bytes=device_bytes)
    try:
        p = plan(Request(tuple(argv), gpus, gpu, "train"))
    except Exception as e:  # noqa: BLE001 - a summary row, not a check
        return f"not planned ({one_line(e)})", None
    m, t = p.memory, p.time
    if device_bytes is None:
        return (f"activations {format_bytes(m.breakdown.get('activations', 0))} kept for backward at the allocated "
                f"peak of {format_bytes(m.peak)} ({m.peak_at}; scripts/plan.py)"), None
    parts = " | ".join(f"{k} {v / GIB:.1f}" for k, v in m.breakdown.items() if v)
    peak = (f"{m.peak / GIB:.1f} GiB allocated at {m.peak_at}, reserve {m.reserved / GIB:.1f} GiB, of the device's "
            f"{device_bytes / GIB:.1f} (GiB: {parts}; scripts/plan.py)")
    speed = (f"{t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {t.step_s:.3f} s per step (H200 kernel rates; "
             "scripts/plan.py)") if "H200" in device_name else None
    return peak, speed


def _accumulate(sums: dict[str, Any], key: str, value: torch.Tensor) -> None:
    sums[key] = sums[key] + value if key in sums else value


class Trainer:
    """Owns everything a run needs; `train()` runs the loop from the restored step to training.steps."""

    def __init__(self, cfg: JobConfig, *, argv: list[str] | None = None,
                 layout: tuple[ParallelDims, Glm5ModelArgs] | None = None) -> None:
        """layout: check_layout's result where the caller has run check_layout and check_this_host already (main
        does, to exit 2 before logging starts); None runs both here."""
        self.cfg = cfg
        self.argv = argv  # train.py's arguments, for the start-up summary's planned figures (None: no plan)
        if layout is None:
            layout = check_layout(cfg)
            check_this_host(cfg)
        dims, self.args = layout
        self.rank, self.world, self.device = init_distributed(cpu_backend=cfg.optimizer.cpu_offload)
        if cfg.training.device_memory_limit_gib:
            fraction = limit_device_memory(cfg.training.device_memory_limit_gib, self.device)
            if self.rank == 0:
                logger.info("CUDA memory limit: %g GiB per process (%.1f%% of the card; "
                            "training.device_memory_limit_gib)", cfg.training.device_memory_limit_gib, 100 * fraction)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        self.dims = dims
        self.meshes = dims.build_mesh(self.device.type)
        # gradients are averaged over the ranks that see different tokens; batches are dealt over dp
        self.dp_size = dims.dp_cp
        self.dp_group = self.meshes["dp_cp"].get_group()
        # CPU collectives of the data loader's set-up and of the HF import/export (the default group may be NCCL)
        self.cpu_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # Context parallelism: the cp ranks of a data-parallel rank read the same rows; each computes its zigzag part.
        self.cp = None
        if dims.cp > 1:
            cp_mesh = self.meshes["cp"]
            self.cp = (cp_mesh.get_group(), CPLayout(size=dims.cp, rank=cp_mesh.get_local_rank()))

        # The inputs are checked before the model is built: a tokenizer that does not fit the model, a bad jsonl
        # line, a non-UTF-8 txt file or an out-of-vocabulary .bin token id stops every rank here. Every rank of a
        # data-parallel rank (its tensor/context-parallel peers) reads the same rows of the global batch; all ranks
        # share the one-off token counting of text corpora (over a gloo group: CPU objects).
        self.tokenizer = build_tokenizer(cfg=cfg.data)
        check_vocab_fits(self.tokenizer, vocab_size=self.args.vocab_size, model=_model_source(cfg))
        self.dataloader = build_dataloader(
            cfg=cfg.data, tokenizer=self.tokenizer, seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size, dp_rank=self.meshes["dp"].get_local_rank(),
            dp_world_size=dims.dp, seed=cfg.job.seed, vocab_size=self.args.vocab_size, group=self.cpu_group)

        torch.manual_seed(cfg.job.seed)
        with torch.device("meta"):
            model = Glm5Model(self.args)
        self.float8 = convert_float8(model, cfg=cfg.float8)
        if self.rank == 0:
            print(self.float8.line(), flush=True)
            for warning in (self.float8.nothing_converted(), cfg.float8.idle_keys()):
                if warning:
                    logger.warning(warning)
        configure_inductor_for_float8(cfg=cfg.float8)
        small = sum(p.numel() for p in model.parameters()) <= _MATERIALIZE_INIT_MAX_PARAMS
        if small:
            model.to_empty(device=self.device)
            model.init_weights()
        if cfg.loss.indexer_stage == "dense_warmup":
            for name, p in model.named_parameters():
                p.requires_grad_(p.requires_grad and ".indexer." in name)
        self.compute_pool = compute_pool_wanted(cfg.parallelism.fsdp_reduce_in_compute_pool,
                                                splits_parameters=dims.splits_parameters,
                                                cpu_offload=cfg.optimizer.cpu_offload)
        self.replicated = parallelize_glm5(
            model, meshes=self.meshes, param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce, ac_mode=cfg.activation_checkpoint.mode,
            recompute_modules=cfg.activation_checkpoint.recompute_modules,
            moe_chunk_tokens=cfg.activation_checkpoint.moe_chunk_tokens,
            offload_inputs=cfg.activation_checkpoint.offload_inputs,
            kda_disable_recompute=cfg.activation_checkpoint.kda_disable_recompute,
            compile_enable=cfg.compile.enable, compile_backend=cfg.compile.backend, compile_mode=cfg.compile.mode,
            compile_components=cfg.compile.components, cpu_offload=cfg.optimizer.cpu_offload,
            expert_fsdp=cfg.parallelism.expert_fsdp, fsdp_reshard=cfg.parallelism.fsdp_reshard_after_forward,
            reduce_in_compute_pool=self.compute_pool)
        if not small:
            model.to_empty(device=self.device)
            model.init_weights()
        self.replicated.broadcast()
        self.model = model
        self.accumulation = GradientAccumulation.build(
            model=model, steps=cfg.training.accumulation_steps(dims.dp), cpu_offload=cfg.optimizer.cpu_offload,
            fsdp_reshard=cfg.parallelism.fsdp_reshard_after_forward)

        self.optimizer = build_optimizer(model=model, cfg=cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(optimizer=self.optimizer, cfg=cfg.lr_scheduler,
                                               total_steps=cfg.training.steps)
        self.skipped = _SkippedSteps()
        self.stats = StepStats(device=self.device, tp=dims.tp, dp_size=self.dp_size)
        # fused AdamW and the fused low-bit step skip a non-finite update on the device; other optimizers (and steps
        # on offloaded host parameters) read the flag each step
        self.device_skip = supports_device_skip(self.optimizer, device=self.device)
        on_cuda = any(p.device.type == "cuda" for g in self.optimizer.param_groups for p in g["params"])
        self.run_info = run_info(cfg=cfg, args=self.args, tokenizer_vocab_size=self.tokenizer.vocab_size,
                                 layout=dims.describe(),
                                 global_batch_rows=self.dataloader.global_batch_rows * self.accumulation.steps,
                                 optimizer_step=resolved_implementation(cfg.optimizer, on_cuda=on_cuda))
        self.checkpointer = CheckpointManager(
            cfg=cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, extra_state={"skipped_steps": self.skipped},
            hf_load_fn=self._hf_load, hf_save_fn=self._hf_save, run_info=self.run_info)
        self.logger = build_metrics_logger(cfg=cfg.metrics, dump_folder=cfg.job.dump_folder, rank=self.rank)
        self.memory = DeviceMemoryMonitor(self.device)
        self.profiler = StepProfiler(cfg=cfg.profiling, dump_folder=cfg.job.dump_folder, rank=self.rank,
                                     device=self.device)
        self.flops_per_token = flops_per_token(self.args, cfg.training.seq_len)
        self.peak_flops = get_peak_flops(
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        self.step = 0
        self.stop = StopRequest()

    def _hf_save(self, model: torch.nn.Module, out_dir: str) -> None:
        from torchtitan_glm.models.glm5.hf_distributed import save_hf_from_sharded

        ckpt = self.cfg.checkpoint
        # the tokenizer goes with the weights: the folder loads in transformers and serving engines as trained
        save_hf_from_sharded(model, out_dir, dtype=getattr(torch, ckpt.export_dtype), fp8=ckpt.export_fp8,
                             keep_bf16=self.cfg.float8.keep_bf16, process_group=self.cpu_group,
                             extra_files=self.tokenizer.hf_files() if self.rank == 0 else None)

    def _hf_load(self, model: torch.nn.Module, path: str) -> None:
        from torchtitan_glm.models.glm5.hf_distributed import load_hf_weights_into

        try:
            load_hf_weights_into(model, path, process_group=self.cpu_group)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            if is_expected(e):
                raise
            raise CheckpointError(f"cannot load the HF checkpoint {path} (checkpoint.initial_load_path): "
                                  f"{one_line(e)}") from e

    # ---------------------------------------------------------------------------------------------- step
    def next_batches(self) -> tuple[list[dict[str, torch.Tensor]], list[str]]:
        """The next optimizer step's microbatches (training.global_batch_size) and where they came from."""
        batches, documents = [], []
        for _ in range(self.accumulation.steps):
            batches.append(next(self.dataloader))
            documents.extend(self.dataloader.last_documents)
        return batches, list(dict.fromkeys(documents))

    def train_step(self, batches: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
                   documents: list[str] | None = None) -> PendingStep:
        """One optimizer step over one batch or a list of microbatches (gradients accumulated), skipped when the loss
        or gradient norm is not finite, queued without a host sync; its metrics come later from `self.stats.resolve`
        (with "nonfinite" and "stop"). `documents`: where the batches came from (default: the loader's last batch).

        Every microbatch's CE and MTP tokens are weighted by the step's global token counts, so the accumulated
        gradient is the one of the whole global batch (to summation order); the indexer KL and the sequence balance
        loss are means over the microbatches of their per-microbatch values, and the router biases move once, by the
        step's summed expert loads."""
        cfg = self.cfg.loss
        batches = [batches] if isinstance(batches, dict) else list(batches)
        documents = list(self.dataloader.last_documents) if documents is None else documents
        micro = [self._device_batch(b) for b in batches]
        n = len(micro)
        count, mtp_count = losses.global_token_counts(*([b.labels for b in micro], [b.mtp_labels for b in micro]),
                                                      group=self.dp_group)
        scale = losses.token_scale(count, dp_size=self.dp_size)
        use_mtp = self.model.mtp is not None
        mtp_scale = cfg.mtp_weight * losses.token_scale(mtp_count, dp_size=self.dp_size) if use_mtp else 0.0
        use_kl = cfg.indexer_kl_coeff > 0 and self.args.num_dsa_layers > 0
        sums: dict[str, Any] = {}  # ce, mtp, kl: summed over the microbatches; loads: per router
        for i, batch_ in enumerate(micro):
            with self.accumulation.microbatch(self.model, self.replicated, last=i == n - 1):
                self._forward_backward(batch_, scale=scale, mtp_scale=mtp_scale, use_kl=use_kl, weight=1 / n,
                                       sums=sums)
        self.replicated.allreduce_grads()
        grad_norm = clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                    self.cfg.training.max_norm)
        # The step's statistics stay on the device until the host needs them (components/step_stats.py); their
        # one all-reduce also carries this rank's stop request, so every rank shares the stop decision.
        pending = self.stats.record(
            step=self.step, lr=self.lr_scheduler.current_lr(), documents=documents, ce_sum=sums["ce"],
            mtp_sum=sums.get("mtp"), kl=sums.get("kl"), grad_norm=grad_norm, count=count, mtp_count=mtp_count,
            stop=self.stop.signum is not None)
        self._optimizer_step(pending, sums.get("loads", []))
        self.stats.finish(pending)
        return pending

    def _forward_backward(self, batch: TrainBatch, *, scale: torch.Tensor, mtp_scale: torch.Tensor | float,
                          use_kl: bool, weight: float, sums: dict[str, Any]) -> None:
        """One microbatch's forward and backward; its CE / MTP-CE sums, indexer KL and expert loads are added into
        `sums`. The KL and the sequence balance loss enter with `weight` (1 / microbatches): their mean over them."""
        cfg = self.cfg.loss
        out = self.model(batch, token_scale=scale, mtp_scale=mtp_scale,
                         indexer_kl=("sparse" if cfg.indexer_sparse_loss else "dense") if use_kl else None,
                         seq_aux=cfg.seq_aux_loss_coeff > 0, ce_chunk_size=cfg.ce_chunk_size)
        # Sparse stage: everything trains on CE + MTP (+ KL for the indexer). Dense warm-up: only the indexer's
        # parameters require grad, and the KL is its objective; the CE is still computed, for the log.
        total = out.loss if cfg.indexer_stage == "sparse" else out.loss.new_zeros(())
        if use_kl:
            kl = weight * losses.indexer_kl_loss(out.indexer_stats, dp_size=self.dp_size, group=self.dp_group)
            total = total + cfg.indexer_kl_coeff * kl
            _accumulate(sums, "kl", kl.detach())
        if cfg.seq_aux_loss_coeff > 0 and out.moe_stats:
            total = total + cfg.seq_aux_loss_coeff * weight * losses.sequence_aux_loss(out.moe_stats)
        total.backward()
        _accumulate(sums, "ce", out.ce.sum())
        if out.mtp_ce is not None and self.model.mtp is not None:
            _accumulate(sums, "mtp", out.mtp_ce.sum())
        if out.moe_stats:
            loads = [st.counts for st in out.moe_stats]
            sums["loads"] = [a + b for a, b in zip(sums["loads"], loads)] if "loads" in sums else loads

    def _device_batch(self, batch: dict[str, torch.Tensor]) -> TrainBatch:
        """A loader batch on the device, as this rank's TrainBatch. Host-to-device without blocking; the document ids
        also stay on the host, from where the KDA kernels' varlen layout is built without a device-to-host copy.
        A batch without document ids (data.document_masking = false) is one causal sequence per row."""
        tokens, labels = (batch[k].to(self.device, non_blocking=True) for k in ("input_ids", "labels"))
        host_ids = batch.get("doc_ids")
        doc_ids = None if host_ids is None else host_ids.to(self.device, non_blocking=True)
        return train_batch(tokens, labels, doc_ids, cp=self.cp,
                           host_doc_ids=host_ids if host_ids is not None and host_ids.device.type == "cpu" else None)

    def _optimizer_step(self, pending: PendingStep, loads: list[torch.Tensor]) -> None:
        """The update, the FP8 scales and the router biases, none of it where the step is not finite: decided on the
        device (found_inf: fused AdamW, the fused low-bit step), else from the one flag read now (see
        components/step_stats.py) under training.on_nonfinite = "skip". Under "stop" the update is not held back:
        the run stops at the step's first read, which comes before any checkpoint or export, so a non-finite update
        is never saved and the step needs no host sync."""
        if self.device_skip:
            optimizer_step(self.optimizer, found_inf=pending.bad)
            precompute_float8_scales(self.model, cfg=self.cfg.float8)  # same weights, same scales when skipped
            apply: torch.Tensor | bool = 1.0 - pending.bad
        else:
            apply = self.cfg.training.on_nonfinite == "stop" or self.stats.flag_now(pending)
            if apply:
                self.optimizer.step()
                precompute_float8_scales(self.model, cfg=self.cfg.float8)
        self.lr_scheduler.step()  # the schedule follows the step count, skipped steps included
        self.optimizer.zero_grad(set_to_none=True)
        if loads and apply is not False:
            imbalance = losses.update_router_bias(
                self.model, loads, rate=self.cfg.loss.router_bias_update_rate,
                group=self.dp_group, scale=apply if isinstance(apply, torch.Tensor) else None)
            pending.extra["expert_load_imbalance"] = imbalance.mean()

    def _read(self, upto: int, losses_seen: list[float]) -> tuple[dict[str, Any] | None, bool]:
        """Resolve the pending steps up to `upto` through the non-finite guard (in order): the last one's metrics
        and whether any asked to stop."""
        last, stop = None, False
        for m in self.stats.resolve(upto):
            self._guard_nonfinite(m)
            losses_seen.append(m["loss"])
            last, stop = m, stop or m["stop"]
        return last, stop

    def _checkpoint_due(self, step: int) -> bool:
        """Whether checkpointer.save(step) writes (the same rule as CheckpointManager.save)."""
        ck = self.cfg.checkpoint
        return ck.enable and (step % ck.interval == 0 or step == self.cfg.training.steps)

    def train(self) -> list[float]:
        """Resume (or start), log the run summary, train to training.steps; returns the losses of the steps run."""
        cfg = self.cfg
        restored = self._resume()
        if restored is not None and restored >= cfg.training.steps:
            return []
        if self.rank == 0:
            device_bytes = device_memory(self.device)  # None off CUDA: planned activations only, nothing pinned
            peak, speed = planned_rows(self.argv, gpus=self.world, device_bytes=device_bytes,
                                       device_name=torch.cuda.get_device_name(self.device) if device_bytes else "")
            logger.info(startup_summary(cfg=cfg, args=self.args, model=self.model, world=self.world,
                                        dp_size=self.dims.dp, device=self.device, resume=self._resume_state,
                                        layout=self.dims.describe() + ("; FSDP2's reduce buffers from the compute "
                                                                       "stream's pool" if self.compute_pool else ""),
                                        device_bytes=device_bytes,
                                        host_pinned=offload_pinned_bytes(cfg, self.args, cp=self.dims.cp)
                                        if device_bytes else 0,
                                        planned=peak, planned_speed=speed, dataloader=self.dataloader))
        self.step = restored or 0
        missed = self.profiler.missed(self.step + 1)
        if missed and self.rank == 0:
            logger.warning(missed)
        losses_seen: list[float] = []
        steps_total = cfg.training.steps
        tokens_per_step = cfg.training.tokens_per_step(self.dims.dp)
        window_start, window_tokens = time.perf_counter(), 0
        run_start = time.perf_counter()
        self.model.train()
        with self.stop, self._metrics_kept_on_error(), self.profiler:
            while self.step < steps_total:
                self.step += 1
                self.profiler.begin(self.step)
                batches, documents = self.next_batches()
                self.train_step(batches, documents)
                window_tokens += tokens_per_step
                log_now = self.step % cfg.metrics.log_freq == 0 or self.step == steps_total
                # The host reads a step's statistics when it logs or saves it, otherwise one step late.
                read_now = log_now or self._checkpoint_due(self.step)
                m, stop = self._read(self.step if read_now else self.step - 1, losses_seen)
                if log_now:
                    elapsed = time.perf_counter() - window_start
                    tps, tflops, mfu = throughput(tokens=window_tokens // self.world, seconds=elapsed,
                                                  flops_per_token=self.flops_per_token, peak_flops=self.peak_flops)
                    mem = self.memory.get_peak_stats()
                    done = self.step - (restored or 0)
                    eta = (time.perf_counter() - run_start) / max(done, 1) * (steps_total - self.step)
                    m.update(tokens_per_sec=tps, tflops=tflops, peak_memory_gib=mem.max_reserved_gib)
                    if mfu is not None:
                        m["mfu_pct"] = mfu
                    if self.rank == 0:
                        extra = {k: m[k] for k in ("mtp_loss", "indexer_kl_loss", "grad_norm", "lr") if k in m}
                        print(format_step_line(step=self.step, total_steps=steps_total, loss=m["loss"],
                                               tokens_per_sec=tps, tflops=tflops, mfu_pct=mfu,
                                               peak_mem_gib=mem.max_reserved_gib, eta_seconds=eta, extra=extra),
                              flush=True)
                    self.logger.log({k: v for k, v in m.items()
                                     if k not in ("tokens", "nonfinite", "stop", "step", "documents")}, self.step)
                    window_start, window_tokens = time.perf_counter(), 0
                if self.profiler.end(self.step):  # the profiler's overhead is not the next log's throughput
                    window_start, window_tokens = time.perf_counter(), 0
                if stop:
                    self._read(self.step, losses_seen)  # the step just run, before its checkpoint
                    self._stop_on_signal()
                    break
                self.checkpointer.save(self.step, last=self.step == steps_total)
        self.checkpointer.close()
        self.logger.close()
        return losses_seen

    @contextlib.contextmanager
    def _metrics_kept_on_error(self) -> Iterator[None]:
        """On an error, write out the buffered TensorBoard events first: the job then exits without teardown."""
        try:
            yield
        except BaseException:
            try:
                self.logger.close()
            except OSError as close_error:  # e.g. the same read-only or full disk: the first error is the one to report
                logger.warning("could not write out the TensorBoard events: %s", close_error)
            raise

    # -------------------------------------------------------------------------------------------- resume
    def _resume(self) -> int | None:
        """Pick the checkpoint to resume from (verified), explain what resuming does, and load it; None for a
        fresh start (after loading checkpoint.initial_load_path, if set)."""
        cfg, ck = self.cfg, self.checkpointer
        step = ck.resume_step()
        if step is None:
            self.logger.purge_from(1)  # an earlier run's events in this folder are superseded from step 1
            if self.rank == 0:
                self._say_what_a_fresh_start_leaves(ck.root)
            ck.load()
            initial = cfg.checkpoint.initial_load_path
            self._resume_state = "fresh start" + (f" from the weights in {initial}" if initial else "")
            return None
        path = step_dir(ck.root, step)
        saved = ck.read_run_info(step)
        if saved is not None:
            mismatches = resume_mismatches(saved, self.run_info)
            if mismatches:
                # the weights fit this model unless a model argument (or the vocabulary) changed
                same_weights = not any(m.startswith(("model.", "tokenizer", "loss.mtp_weight"))
                                       and not m.startswith("model.kpool_ape_trainable") for m in mismatches)
                raise ResumeMismatchError(
                    f"cannot resume from {path}: {'; '.join(mismatches[:4])}"
                    + (f" (and {len(mismatches) - 4} more)" if len(mismatches) > 4 else "")
                    + "; an exact resume needs the same values: set them back, or start fresh with a new "
                    "--job.dump_folder" + (f" (--checkpoint.initial_load_path {path} starts it from these weights, "
                                           "with fresh optimizer state)" if same_weights else ""))
        if cfg.training.steps < step:
            raise ResumeMismatchError(
                f"training.steps={cfg.training.steps} is below the step of the checkpoint to resume, {path}: "
                f"nothing to train. Raise --training.steps above {step} to continue, pick an earlier checkpoint with "
                "--checkpoint.load_step, or start fresh with a new --job.dump_folder")
        if cfg.training.steps == step:
            if self.rank == 0:
                logger.info("training is complete: the checkpoint %s is at training.steps=%d; nothing to do (raise "
                            "--training.steps to train further)", path, step)
                changed = (precision_changes(saved, self.run_info) + optimizer_changes(saved, self.run_info)
                           if saved is not None else [])
                if changed:
                    logger.warning("this run's settings differ from the checkpoint's (%s) and trained nothing with "
                                   "them: to train with them, use a new --job.dump_folder", ", ".join(changed))
            if cfg.checkpoint.last_save_in_hf and step not in list_hf_exports(ck.root):
                ck.load(step)  # the final export this run asks for, from the final checkpoint
                ck.export_hf(step)
            return step
        note = schedule_note(saved, self.run_info, step) if saved is not None else None
        ck.load(step)
        self._resume_state = (f"resumed from the step-{step} checkpoint {path}, training to step "
                              f"{cfg.training.steps}; to start fresh instead, use a new --job.dump_folder")
        changed = layout_note(saved, self.run_info, next_row=self.dataloader.position) if saved is not None else None
        precision = precision_note(saved, self.run_info) if saved is not None else None
        optim = optimizer_note(saved, self.run_info, step) if saved is not None else None
        self.logger.purge_from(step + 1)  # TensorBoard hides an earlier run's events past the resume step
        if self.rank == 0:
            logger.info(self._resume_state)
            if cfg.checkpoint.initial_load_path:
                logger.warning("checkpoint.initial_load_path %s is not read: this run resumes from its own "
                               "checkpoint (initial_load_path starts a fresh run only; for those weights, use a new "
                               "--job.dump_folder)", cfg.checkpoint.initial_load_path)
            for line in (note, changed, precision, optim):
                if line:
                    logger.warning(line)
        return step

    def _say_what_a_fresh_start_leaves(self, root: str) -> None:
        """Warn when a fresh start passes over an earlier run's outputs in its folder: checkpoints it does not resume
        (checkpointing off), or HF exports (a model-only last save), which only initial_load_path reads."""
        if not self.cfg.checkpoint.enable and list_checkpoints(root):
            logger.warning("checkpoint.enable = false: the checkpoints in %s are not resumed from (this run starts "
                           "at step 1 and saves none)", root)
        exports = list_hf_exports(root)
        if exports and not self.cfg.checkpoint.initial_load_path:
            newest = hf_export_dir(root, exports[-1])
            logger.warning("%s holds the HF export %s of an earlier run, which a run does not resume from: this one "
                           "starts fresh; to start from those weights, set checkpoint.initial_load_path = %s and "
                           "checkpoint.initial_load_in_hf = true", root, newest, newest)

    # ------------------------------------------------------------------------------------------ stopping
    def _guard_nonfinite(self, m: dict[str, Any]) -> None:
        """training.on_nonfinite for the resolved step m (this one or the one before): stop (NonFiniteError,
        nothing saved) or count a skipped step; every rank takes the same decision, from all-reduced values."""
        if not m["nonfinite"]:
            self.skipped.in_a_row = 0
            if self.cfg.training.on_nonfinite == "skip":
                m["skipped_steps"] = self.skipped.total
            return
        what, step = ", ".join(m["nonfinite"]), m["step"]
        tr = self.cfg.training
        if tr.on_nonfinite == "skip":
            self.skipped.total += 1
            self.skipped.in_a_row += 1
            # logged now, whether or not this is a log step (not also through m: one event per step)
            self.logger.log({"skipped_steps": self.skipped.total}, step)
            if self.skipped.in_a_row < tr.max_consecutive_nonfinite:
                if self.rank == 0:
                    logger.warning("step %d: non-finite %s: skipped its optimizer step (%d in a row; the run stops at "
                                   "%d, training.max_consecutive_nonfinite)", step, what, self.skipped.in_a_row,
                                   tr.max_consecutive_nonfinite)
                return
            cause = (f"{self.skipped.in_a_row} steps in a row had a non-finite loss or gradient norm "
                     f"(training.max_consecutive_nonfinite={tr.max_consecutive_nonfinite}); the last, step "
                     f"{step}, had {what}")
        else:
            cause = f"non-finite {what} at step {step} (training.on_nonfinite='stop')"
        docs = self._batch_documents(m["documents"])
        listing = os.path.join(self.cfg.job.dump_folder, f"nonfinite-step-{step}.txt")
        if self.rank == 0:
            os.makedirs(self.cfg.job.dump_folder, exist_ok=True)
            with open(listing, "w", encoding="utf-8") as f:
                f.write("\n".join(docs) + "\n")
        saved = list_checkpoints(self.checkpointer.root)
        newest = f"; the newest checkpoint is {step_dir(self.checkpointer.root, saved[-1])}" if saved else ""
        shown = ", ".join(docs[:_DOCS_IN_MESSAGE]) + (f" and {len(docs) - _DOCS_IN_MESSAGE} more"
                                                    if len(docs) > _DOCS_IN_MESSAGE else "")
        advice = ("or set training.on_nonfinite='skip'" if tr.on_nonfinite == "stop"
                  else "or raise training.max_consecutive_nonfinite")
        raise NonFiniteError(f"{cause}; this state is not saved{newest}. The step's batch came from {shown} (all "
                             f"in {listing}). Lower optimizer.lr or training.max_norm, check those documents, {advice}")

    def _batch_documents(self, documents: list[str]) -> list[str]:
        """Where a step's batch came from (this rank's `documents`), on every rank (collective)."""
        docs = list(documents)
        if dist.is_initialized():
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, docs)
            docs = [d for part in parts for d in part]
        return list(dict.fromkeys(docs))

    def _stop_on_signal(self) -> None:
        """A SIGTERM/SIGINT reached a rank: save the step just finished and say how to continue."""
        steps_total = self.cfg.training.steps
        saved = self.checkpointer.save(self.step, last=self.step == steps_total, force=True)
        self.checkpointer.close()
        if self.rank == 0:
            where = (f"saved checkpoint {step_dir(self.checkpointer.root, self.step)}; run the same command again to "
                     "resume" if saved else "checkpoint.enable is false: nothing was saved")
            logger.info("stopped by %s after step %d of %d: %s", self.stop.name or "a signal on another rank",
                        self.step, steps_total, where)

    def close(self) -> None:
        """Release the process group (no barrier: after an error elsewhere it could wait forever)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(cfg: JobConfig, argv: list[str], layout: tuple[ParallelDims, Glm5ModelArgs]) -> None:
    trainer = Trainer(cfg, argv=argv, layout=layout)
    trainer.train()
    trainer.close()


@main_guard
def main(argv: list[str] | None = None) -> None:
    alloc = default_alloc_conf()  # before anything allocates on the device
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(argv)  # ConfigError -> exit 2 before any process group starts
    layout = check_layout(cfg)  # the same for the parallel layout against the world size and the model
    check_this_host(cfg)
    check_output_folders(cfg)  # and for the folders it will write into
    init_logging(rank=int(os.environ.get("RANK", 0)))
    if torch.cuda.is_available():
        logger.info("CUDA allocator: %s", alloc)
    run_job(lambda: _run(cfg, argv, layout))  # an error on any rank: reported once, every rank exits within seconds
