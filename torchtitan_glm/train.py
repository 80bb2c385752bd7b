"""The Trainer: build (mesh, model, FSDP2/compile/AC, optimizer, data, checkpoints), then the training loop."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from torchtitan_glm.components import loss as losses
from torchtitan_glm.components.checkpoint import CheckpointManager
from torchtitan_glm.components.data import build_dataloader
from torchtitan_glm.components.lr_scheduler import build_lr_scheduler
from torchtitan_glm.components.metrics import (
    DeviceMemoryMonitor, build_metrics_logger, flops_per_token, format_step_line, get_peak_flops, throughput,
)
from torchtitan_glm.components.optimizer import build_optimizer, clip_grad_norm_
from torchtitan_glm.components.tokenizer import build_tokenizer
from torchtitan_glm.config import JobConfig, load_config, main_guard
from torchtitan_glm.distributed.parallel_dims import ParallelDims
from torchtitan_glm.float8 import configure_inductor_for_float8, convert_float8, precompute_float8_scales
from torchtitan_glm.models.glm5 import Glm5Model, Glm5ModelArgs
from torchtitan_glm.models.glm5.model import mtp_targets
from torchtitan_glm.models.glm5.parallelize import (
    allreduce_replicated_grads, broadcast_replicated_params, parallelize_glm5,
)

# Models up to this size are initialised whole on every rank before sharding, which makes the initial weights
# independent of the world size; larger ones are built on meta and initialised shard by shard.
_MATERIALIZE_INIT_MAX_PARAMS = 2_000_000_000


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


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun process group (NCCL on GPU, gloo on CPU); a plain `python train.py` is a world of one."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return rank, world, device


class Trainer:
    """Owns everything a run needs; `train()` runs the loop from the restored step to training.steps."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed()
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        dims = ParallelDims.from_config(dp_shard=cfg.parallelism.data_parallel_shard_degree, world_size=self.world)
        self.dp_size = dims.dp_shard
        self.mesh = dims.build_mesh(self.device.type)
        self.args = build_model_args(cfg)

        torch.manual_seed(cfg.job.seed)
        with torch.device("meta"):
            model = Glm5Model(self.args)
        self.float8 = convert_float8(model, cfg=cfg.float8)
        if self.rank == 0:
            print(self.float8.line(), flush=True)
        configure_inductor_for_float8(cfg=cfg.float8)
        small = sum(p.numel() for p in model.parameters()) <= _MATERIALIZE_INIT_MAX_PARAMS
        if small:
            model.to_empty(device=self.device)
            model.init_weights()
        if cfg.loss.indexer_stage == "dense_warmup":
            for name, p in model.named_parameters():
                p.requires_grad_(p.requires_grad and ".indexer." in name)
        self.replicated = parallelize_glm5(
            model, mesh=self.mesh, param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce, ac_mode=cfg.activation_checkpoint.mode,
            compile_enable=cfg.compile.enable, compile_backend=cfg.compile.backend, compile_mode=cfg.compile.mode,
            compile_components=cfg.compile.components)
        if not small:
            model.to_empty(device=self.device)
            model.init_weights()
        broadcast_replicated_params(self.replicated)
        self.model = model

        self.optimizer = build_optimizer(model=model, cfg=cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(optimizer=self.optimizer, cfg=cfg.lr_scheduler,
                                               total_steps=cfg.training.steps)
        self.tokenizer = build_tokenizer(cfg=cfg.data)
        if self.tokenizer.vocab_size > self.args.vocab_size:
            raise ValueError(f"tokenizer vocabulary ({self.tokenizer.vocab_size}) exceeds the model's vocab_size "
                             f"({self.args.vocab_size})")
        self.dataloader = build_dataloader(
            cfg=cfg.data, tokenizer=self.tokenizer, seq_len=cfg.training.seq_len,
            local_batch_size=cfg.training.local_batch_size, dp_rank=self.rank, dp_world_size=self.dp_size,
            seed=cfg.job.seed)
        self.checkpointer = CheckpointManager(
            cfg=cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            hf_load_fn=_hf_load, hf_save_fn=self._hf_save)
        self.logger = build_metrics_logger(cfg=cfg.metrics, dump_folder=cfg.job.dump_folder, rank=self.rank)
        self.memory = DeviceMemoryMonitor(self.device)
        self.flops_per_token = flops_per_token(self.args, cfg.training.seq_len)
        self.peak_flops = get_peak_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        self.step = 0

    def _hf_save(self, model: torch.nn.Module, out_dir: str) -> None:
        from torchtitan_glm.models.glm5.hf_distributed import save_hf_from_sharded

        ckpt = self.cfg.checkpoint
        save_hf_from_sharded(model, out_dir, dtype=getattr(torch, ckpt.export_dtype), fp8=ckpt.export_fp8,
                             keep_bf16=self.cfg.float8.keep_bf16)

    # ---------------------------------------------------------------------------------------------- step
    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        cfg = self.cfg.loss
        tokens = batch["input_ids"].to(self.device)
        labels = batch["labels"].to(self.device)
        doc_ids = batch["doc_ids"].to(self.device)
        count, mtp_count = losses.global_token_counts(labels, mtp_targets(labels))
        scale = losses.token_scale(count, dp_size=self.dp_size)
        use_mtp = self.model.mtp is not None
        mtp_scale = cfg.mtp_weight * losses.token_scale(mtp_count, dp_size=self.dp_size) if use_mtp else 0.0
        use_kl = cfg.indexer_kl_coeff > 0 and self.args.num_dsa_layers > 0
        out = self.model(tokens, doc_ids=doc_ids, labels=labels, token_scale=scale, mtp_scale=mtp_scale,
                         collect_indexer_stats=use_kl, indexer_sparse_loss=cfg.indexer_sparse_loss,
                         seq_aux=cfg.seq_aux_loss_coeff > 0,
                         ce_chunk_size=cfg.ce_chunk_size)
        # Sparse stage: everything trains on CE + MTP (+ KL for the indexer). Dense warm-up: only the indexer's
        # parameters require grad, and the KL is its objective; the CE is still computed, for the log.
        total = out.loss if cfg.indexer_stage == "sparse" else out.loss.new_zeros(())
        kl = None
        if use_kl:
            kl = losses.indexer_kl_loss(out.indexer_stats)
            total = total + cfg.indexer_kl_coeff * kl
        if cfg.seq_aux_loss_coeff > 0 and out.moe_stats:
            total = total + cfg.seq_aux_loss_coeff * losses.sequence_aux_loss(out.moe_stats)
        total.backward()
        allreduce_replicated_grads(self.replicated)
        grad_norm = clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                    self.cfg.training.max_norm)
        self.optimizer.step()
        precompute_float8_scales(self.model, cfg=self.cfg.float8)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        imbalance = None
        if out.moe_stats:
            imbalance = losses.update_router_bias(self.model, [s.counts for s in out.moe_stats],
                                                  rate=cfg.router_bias_update_rate)
        sums = torch.stack([out.ce.sum(), out.mtp_ce.sum() if out.mtp_ce is not None else out.ce.new_zeros(()),
                            kl.detach() if kl is not None else out.ce.new_zeros(())])
        if dist.is_initialized():
            dist.all_reduce(sums)
        metrics = {"loss": float(sums[0] / count), "grad_norm": float(grad_norm),
                   "lr": self.lr_scheduler.get_last_lr()[0], "tokens": int(count)}
        if use_mtp:
            metrics["mtp_loss"] = float(sums[1] / mtp_count.clamp_min(1))
        if kl is not None:
            metrics["indexer_kl_loss"] = float(sums[2] / self.dp_size)
        if imbalance is not None:
            metrics["expert_load_imbalance"] = float(imbalance.mean())
        return metrics

    def train(self) -> list[float]:
        cfg = self.cfg
        restored = self.checkpointer.load()
        self.step = restored or 0
        if restored is not None and self.rank == 0:
            print(f"resumed from the step-{restored} checkpoint in {cfg.job.dump_folder}; training to step "
                  f"{cfg.training.steps}", flush=True)
        losses_seen: list[float] = []
        steps_total = cfg.training.steps
        tokens_per_step = cfg.training.seq_len * cfg.training.local_batch_size * self.dp_size
        window_start, window_tokens = time.perf_counter(), 0
        run_start = time.perf_counter()
        self.model.train()
        while self.step < steps_total:
            self.step += 1
            batch = next(self.dataloader)
            m = self.train_step(batch)
            losses_seen.append(m["loss"])
            window_tokens += tokens_per_step
            if self.step % cfg.metrics.log_freq == 0 or self.step == steps_total:
                elapsed = time.perf_counter() - window_start
                tps, tflops, mfu = throughput(tokens=window_tokens // self.dp_size, seconds=elapsed,
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
                self.logger.log({k: v for k, v in m.items() if k != "tokens"}, self.step)
                window_start, window_tokens = time.perf_counter(), 0
            self.checkpointer.save(self.step, last=self.step == steps_total)
        self.checkpointer.close()
        self.logger.close()
        return losses_seen

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _hf_load(model: torch.nn.Module, path: str) -> None:
    from torchtitan_glm.models.glm5.hf_distributed import load_hf_weights_into

    load_hf_weights_into(model, path)


@main_guard
def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)  # ConfigError -> exit 2 before any process group starts
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
