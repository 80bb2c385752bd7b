"""JobConfig: one frozen dataclass per TOML section, TOML loading, dotted CLI overrides and validation.

Precedence is command line > TOML file > dataclass defaults. Every problem (unknown section or key, wrong type,
bad value, unsupported combination) raises `ConfigError`, whose message names the dotted key and the config file;
`main_guard` turns it into exit code 2 before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import inspect
import math
import os
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = [
    "ConfigError", "JobConfig", "JobSectionConfig", "ModelConfig", "TrainingConfig", "DataConfig", "OptimizerConfig",
    "LRSchedulerConfig", "LossConfig", "ParallelismConfig", "Float8Config", "CheckpointConfig",
    "ActivationCheckpointConfig", "CompileConfig", "MetricsConfig", "ProfilingConfig", "load_config", "main_guard",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid configuration. `key` is the dotted key (or section, or CLI argument); `source` says where the
    offending value came from (config file, command line or default), always naming the config file if there is one.
    `host`: the value names something this machine lacks (a file), so the config may be right for another one."""

    def __init__(self, key: str, message: str, source: str | None = None, *, host: bool = False) -> None:
        self.key, self.message, self.source, self.host = key, message, source, host
        where = f" ({source})" if source else ""
        super().__init__(f"config error at `{key}`{where}: {message}")

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.key, self.message, source, host=self.host)


class _Section:
    """Mixin for section dataclasses: the section name and helpers that raise ConfigError naming `section.key`."""

    SECTION: ClassVar[str] = ""

    @classmethod
    def extra_keys(cls) -> dict[str, Any]:
        """Keys besides the fields, name -> type, collected into the section's one dict field."""
        return {}

    def validate(self) -> None:
        """Check this section's values on their own (cross-section rules live in JobConfig.validate)."""

    def _fail(self, key: str, message: str) -> None:
        raise ConfigError(f"{self.SECTION}.{key}", message)

    def _require(self, ok: bool, key: str, message: str) -> None:
        if not ok:
            self._fail(key, f"{message}, got {getattr(self, key)!r}")

    def _choice(self, key: str, allowed: typing.Iterable[str]) -> None:
        allowed = tuple(allowed)
        if getattr(self, key) not in allowed:
            self._fail(key, f"must be one of {list(allowed)}, got {getattr(self, key)!r}")

    def _path_exists(self, key: str, path: str) -> None:
        if not os.path.exists(path):
            from torchtitan_glm.components.data import glob_hint  # data.py imports this module

            raise ConfigError(f"{self.SECTION}.{key}",
                              f"path does not exist: {path}" + (glob_hint(path) if key == "paths" else ""), host=True)


@dataclass(frozen=True)
class JobSectionConfig(_Section):
    """[job] Run identity.

    dump_folder: root for checkpoints and tensorboard output; description: logged at start;
    seed: seeds model initialisation and the data order.
    """

    SECTION: ClassVar[str] = "job"
    dump_folder: str = "./outputs"
    description: str = ""
    seed: int = 0

    def validate(self) -> None:
        self._require(bool(self.dump_folder), "dump_folder", "must be a non-empty path")
        self._require(self.seed >= 0, "seed", "must be >= 0")


# Glm5ModelArgs per-layer lists and the fields they are derived from (Glm5ModelArgs.__post_init__).
_DERIVED_LISTS = {"num_hidden_layers": ("layer_types", "mlp_layer_types", "indexer_types"),
                  "first_k_dense_replace": ("mlp_layer_types",)}


@dataclass(frozen=True)
class ModelConfig(_Section):
    """[model] Which model to build.

    name: model family (only "glm5"); flavor: a named Glm5ModelArgs preset (models/glm5/args.py FLAVORS);
    hf_config: path to an HF config.json or checkpoint directory; when set it overrides `flavor`.
    Any other key is a Glm5ModelArgs field set on top of the flavor / hf_config (`args`), e.g. `hc_mult = 2`.
    The precision controls (defaults: what the transformers reference computes; train_configs/glm5_3_flash.toml
    sets the Megatron PR's values):
      indexer_fp8_emulation: the indexer query and pooled keys through serving's FP8 path (Hadamard, power-of-two
        scale, E4M3, dequantised; straight-through gradient);
      mhc_fp32_mixing: the mHC residual mixing in FP32 with one final cast;
      kpool_fp32_accumulate: the KPool weighted sum accumulated in FP32, one BF16 pooled key;
      indexer_weights_fp32, indexer_k_norm_fp32: the indexer's head-weight projection / key LayerNorm in FP32;
      kpool_ape_trainable: train the KPool absolute position embedding (false: frozen);
      hc_head: how the final mHC streams become one, "mean" or "learned".
    """

    SECTION: ClassVar[str] = "model"
    # Glm5ModelArgs fields the trainer sets from another key: what to set instead.
    DERIVED_KEYS: ClassVar[dict[str, str]] = {
        "dsa_attention": "is set by the trainer from loss.indexer_stage (\"dense_warmup\" runs DSA attention "
                         "dense, \"sparse\" the top-k selection): set that key instead",
        "indexer_tile_elements": "is set by the trainer from loss.indexer_tile_elements: set that key instead",
        "router_aux_loss_coef": "is the HF config's value, carried to exports unchanged; the trainer's auxiliary "
                                "load-balancing loss is weighted by loss.seq_aux_loss_coeff: set that key instead"}
    name: str = "glm5"
    flavor: str = "debug"
    hf_config: str = ""
    args: dict = field(default_factory=dict)  # Glm5ModelArgs overrides, written as plain [model] keys

    @classmethod
    def extra_keys(cls) -> dict[str, Any]:
        """Glm5ModelArgs fields, settable as [model] keys (set by the trainer itself: dsa_attention)."""
        from torchtitan_glm.models.glm5.args import Glm5ModelArgs

        hints = typing.get_type_hints(Glm5ModelArgs)
        return {f.name: hints[f.name] for f in dataclasses.fields(Glm5ModelArgs) if f.name not in cls.DERIVED_KEYS}

    def model_args(self):
        """The Glm5ModelArgs these keys describe (hf_config, else flavor, then the overrides)."""
        from torchtitan_glm.models.glm5.args import Glm5ModelArgs, get_flavor

        changes = dict(self.args)
        # per-layer lists the flavor / hf_config derived from an overridden field are derived again (None), unless
        # given too
        derived = {k for field_, lists in _DERIVED_LISTS.items() if field_ in changes for k in lists}
        changes = {**dict.fromkeys(derived), **changes}
        if self.hf_config:
            return Glm5ModelArgs.from_hf_config(self.hf_config, **changes)
        return get_flavor(self.flavor).replace(**changes)

    def validate(self) -> None:
        from torchtitan_glm.models.glm5.args import FLAVORS, ModelArgsError

        self._choice("name", ("glm5",))
        if self.args.get("tie_word_embeddings"):
            self._fail("tie_word_embeddings", "the LM head trains as its own weight (GLM-5.3-Flash is untied; a "
                       "tied HF checkpoint loads with the head copied from the embedding): tying is not implemented")
        self._choice("flavor", sorted(FLAVORS))
        if self.hf_config:
            self._path_exists("hf_config", self.hf_config)
            problem = hf_model_type_problem(self.hf_config)
            if problem:
                self._fail("hf_config", problem)
        try:
            self.model_args()
        except ModelArgsError as e:
            if e.key in self.args:
                self._fail(e.key, str(e))
            if len(self.args) == 1:  # the flavor / hf_config alone is valid, so the one override broke it
                key, value = next(iter(self.args.items()))
                self._fail(key, f"{key} = {value!r} on {self.hf_config or self.flavor}: {e}")
            self._fail("hf_config" if self.hf_config else "flavor",
                       f"{self.hf_config or self.flavor}: {e}")
        except TypeError as e:
            self._fail("hf_config", f"{self.hf_config}: {e}")


_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class TrainingConfig(_Section):
    """[training] The optimisation loop.

    steps: optimizer steps to run (also the LR schedule length); seq_len: tokens per row;
    local_batch_size: rows per data-parallel rank per forward/backward (a microbatch); global_batch_size: rows per
    optimizer step over all data-parallel ranks, -1 = local_batch_size x the data-parallel degree; a multiple of that
    product accumulates gradients over global / (local x dp) microbatches (TorchTitan's key); max_norm: global
    gradient-norm clip (> 0);
    mixed_precision_param / mixed_precision_reduce: FSDP2 MixedPrecisionPolicy param and gradient-reduce dtypes;
    deterministic: use deterministic algorithms (torch.use_deterministic_algorithms) for reproducible runs;
    on_nonfinite: what a non-finite loss or gradient norm does: "stop" (exit non-zero naming the step and the
    batch's documents; that state is never saved) or "skip" (drop the step's update, count it in TensorBoard as
    skipped_steps); max_consecutive_nonfinite: with "skip", stop after this many non-finite steps in a row;
    device_memory_limit_gib: CUDA memory this process may reserve (torch.cuda.set_per_process_memory_fraction),
    0 = the whole card. Under it the caching allocator gives cached blocks back before an allocation would pass the
    limit, so the reserve stays within it (for a budget, or to leave room for a co-located rollout engine). It
    bounds the caching allocator only: the CUDA context, NCCL's buffers and library workspaces come on top.
    """

    SECTION: ClassVar[str] = "training"
    steps: int = 10
    seq_len: int = 2048
    local_batch_size: int = 1
    global_batch_size: int = -1
    max_norm: float = 1.0
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    deterministic: bool = False
    on_nonfinite: str = "stop"
    max_consecutive_nonfinite: int = 5
    device_memory_limit_gib: float = 0.0

    def validate(self) -> None:
        self._require(self.steps >= 1, "steps", "must be >= 1")
        self._require(self.seq_len >= 1, "seq_len", "must be > 0")
        self._require(self.local_batch_size >= 1, "local_batch_size", "must be >= 1")
        self._require(self.global_batch_size == -1 or self.global_batch_size >= 1, "global_batch_size",
                      "must be -1 (local_batch_size x the data-parallel degree) or >= 1")
        self._require(math.isfinite(self.max_norm) and self.max_norm > 0, "max_norm", "must be a finite number > 0")
        self._choice("mixed_precision_param", _DTYPES)
        self._choice("mixed_precision_reduce", _DTYPES)
        self._choice("on_nonfinite", ("stop", "skip"))
        self._require(self.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite", "must be >= 1")
        self._require(math.isfinite(self.device_memory_limit_gib) and self.device_memory_limit_gib >= 0,
                      "device_memory_limit_gib", "must be a finite number >= 0 (0 = the whole card)")

    def accumulation_steps(self, dp: int) -> int:
        """Microbatches per optimizer step under `dp` data-parallel ranks (global_batch_size / (local x dp))."""
        rows = self.local_batch_size * dp
        if self.global_batch_size == -1:
            return 1
        if self.global_batch_size % rows:
            self._fail("global_batch_size", f"must be a multiple of local_batch_size x the data-parallel degree = "
                                            f"{self.local_batch_size} x {dp} = {rows}, got {self.global_batch_size}")
        return self.global_batch_size // rows

    def tokens_per_step(self, dp: int) -> int:
        """Global tokens per optimizer step: seq_len x local_batch_size x dp x the accumulated microbatches."""
        return self.seq_len * self.local_batch_size * dp * self.accumulation_steps(dp)


@dataclass(frozen=True)
class DataConfig(_Section):
    """[data] Where tokens come from (components/data.py, components/tokenizer.py).

    source: "builtin" (this Python's standard-library sources; needs no download), "jsonl", "txt" (one document
    per file) or "bin" (pre-tokenized, documents separated by the tokenizer's eos); paths: files or directories
    for jsonl/txt/bin (must be empty for builtin); tokenizer: "byte" (built-in byte-level) or a tokenizer.json
    path (or a directory holding one); text_key: the jsonl field holding the text; bin_dtype: "uint16" or
    "uint32" element type of .bin files (their token ids are checked against the model's vocab_size at start);
    add_eos: append eos after each text document (bin files already hold it); errors: txt files that are not valid
    UTF-8: "strict" (stop at start, naming the file and byte), "skip" (leave them out, with a warning) or "replace"
    (decode bad bytes as U+FFFD); document_masking: true (the reference's packed-row semantics): attention, the
    KDA state, the DSA pools and the MTP restart at each document start in a packed row, and the label that would
    predict a document's first token from the previous document is ignored; false: each row is one causal
    sequence, as TorchTitan and Megatron-LM (without reset_attention_mask) train by default -- the model gets no
    document ids, so (without context parallelism) attention runs with the plain causal kernels and the KDA
    kernels without varlen boundaries, and every label counts.
    """

    SECTION: ClassVar[str] = "data"
    source: str = "builtin"
    paths: list[str] = field(default_factory=list)
    tokenizer: str = "byte"
    text_key: str = "text"
    bin_dtype: str = "uint16"
    add_eos: bool = True
    errors: str = "strict"
    document_masking: bool = True

    def validate(self) -> None:
        self._choice("source", ("builtin", "jsonl", "txt", "bin"))
        if self.source == "builtin":
            self._require(not self.paths, "paths", "must be empty for source='builtin'")
        else:
            self._require(bool(self.paths), "paths", f"needs at least one file for source={self.source!r}")
        for p in self.paths:
            self._path_exists("paths", p)
        if self.tokenizer != "byte":
            self._path_exists("tokenizer", self.tokenizer)
            if os.path.isdir(self.tokenizer) and not os.path.isfile(os.path.join(self.tokenizer, "tokenizer.json")):
                raise ConfigError("data.tokenizer", f"directory {self.tokenizer} has no tokenizer.json", host=True)
        self._require(bool(self.text_key), "text_key", "must be non-empty")
        self._choice("bin_dtype", ("uint16", "uint32"))
        self._choice("errors", ("strict", "skip", "replace"))


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """[optimizer] AdamW (components/optimizer.py).

    name: "AdamW" (torch; states in the parameters' dtype), "AdamW8bit" or "AdamWFp8" (torchao's low-bit AdamW:
    both moments stored blockwise-quantised, 8-bit or FP8 E4M3 codes plus one FP32 scale per 256 values, about 2.03
    bytes per parameter instead of 8 for FP32 states); lr: peak learning rate; beta1, beta2, eps: AdamW moments;
    weight_decay: decoupled decay for parameters with ndim >= 2 not declared no-decay by their module;
    implementation: for AdamW "auto" (fused on CUDA, foreach otherwise), "fused", "foreach" or "for-loop"; for
    AdamW8bit / AdamWFp8 "fused" (the project's step over torchao's states, ops/adamw_lowbit.py: on CUDA one Triton
    kernel per parameter that reads and writes each value once, elsewhere its torch reference; it also takes
    training.on_nonfinite = "skip" on the device, where "compiled" reads the step's flag on the host), "compiled"
    (torchao's own torch.compile'd step, one compile per parameter shape) or "auto" ("fused", the faster on an H200:
    docs/performance.md, sixteenth session); the states and checkpoints are the same either way;
    cpu_offload: keep the FSDP2-sharded parameters, their gradients and optimizer states in host memory and step
    there (FSDP2's CPUOffloadPolicy: the parameters are copied to the GPU for each block's forward and backward, the
    gradients back), AdamW only. torchao's CPUOffloadOptimizer is not offered: it is CUDA-only and for one device,
    keeps one optimizer per parameter over host copies (not FSDP2's DTensors), and its state_dict is not keyed by
    parameter names as the checkpoints need.
    """

    SECTION: ClassVar[str] = "optimizer"
    name: str = "AdamW"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "auto"
    cpu_offload: bool = False

    def validate(self) -> None:
        if self.name == "CPUOffloadOptimizer":
            self._fail("name", "torchao's CPUOffloadOptimizer does not work with FSDP2-sharded parameters or the "
                       "checkpoints; set optimizer.cpu_offload = true (FSDP2's CPUOffloadPolicy) with name 'AdamW'")
        self._choice("name", OPTIMIZERS)
        self._require(math.isfinite(self.lr) and self.lr > 0, "lr", "must be a finite number > 0")
        self._require(0.0 <= self.beta1 < 1.0, "beta1", "must be in [0, 1)")
        self._require(0.0 <= self.beta2 < 1.0, "beta2", "must be in [0, 1)")
        self._require(math.isfinite(self.eps) and self.eps > 0, "eps", "must be a finite number > 0")
        self._require(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0")
        if self.name == "AdamW" and self.implementation in LOW_BIT_IMPLEMENTATIONS + ADAMW_IMPLEMENTATIONS:
            self._require(self.implementation != "compiled", "implementation",
                          "'compiled' is torchao's step of AdamW8bit / AdamWFp8; AdamW takes one of "
                          f"{list(ADAMW_IMPLEMENTATIONS)}")
        elif self.name == "AdamW":
            self._choice("implementation", ADAMW_IMPLEMENTATIONS)
        elif self.implementation in ADAMW_IMPLEMENTATIONS and self.implementation not in LOW_BIT_IMPLEMENTATIONS:
            self._fail("implementation", f"{self.implementation!r} is torch AdamW's; {self.name} takes one of "
                       f"{list(LOW_BIT_IMPLEMENTATIONS)}")
        else:
            self._choice("implementation", LOW_BIT_IMPLEMENTATIONS)
        if self.cpu_offload and self.name != "AdamW":
            self._fail("cpu_offload", f"offloads name 'AdamW' only: {self.name} saves GPU memory by shrinking the "
                       "states, which cpu_offload already keeps in host memory (and torchao's compiled step on the "
                       "host is slow); use one or the other")


OPTIMIZERS = ("AdamW", "AdamW8bit", "AdamWFp8")
ADAMW_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
LOW_BIT_IMPLEMENTATIONS = ("auto", "fused", "compiled")


@dataclass(frozen=True)
class LRSchedulerConfig(_Section):
    """[lr_scheduler] Warmup then decay (components/lr_scheduler.py).

    warmup_steps: linear warmup length (<= training.steps); decay_type: "cosine", "linear" or "wsd"
    (warmup-stable-decay); decay_ratio: for wsd, the fraction of training.steps spent in the final linear decay;
    min_lr_factor: the floor, as a fraction of optimizer.lr.
    """

    SECTION: ClassVar[str] = "lr_scheduler"
    warmup_steps: int = 2
    decay_type: str = "cosine"
    decay_ratio: float = 0.1
    min_lr_factor: float = 0.1

    def validate(self) -> None:
        self._require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._choice("decay_type", ("cosine", "linear", "wsd"))
        self._require(0.0 < self.decay_ratio <= 1.0, "decay_ratio", "must be in (0, 1]")
        self._require(0.0 <= self.min_lr_factor <= 1.0, "min_lr_factor", "must be in [0, 1]")


@dataclass(frozen=True)
class LossConfig(_Section):
    """[loss] Terms of the training objective and router balancing.

    mtp_weight: weight of the multi-token-prediction CE; indexer_kl_coeff: weight of the DSA indexer KL loss;
    indexer_stage: "sparse" (top-k attention, everything trains) or "dense_warmup" (dense attention, only the
    indexer trains; sets the model's dsa_attention="dense"); indexer_sparse_loss: restrict the KL to the selected
    pools, against the sparse attention's own probabilities (sparse stage only; linear in T, where the default KL
    over all visible pools needs dense attention probabilities, O(T^2) work); router_bias_update_rate:
    aux-loss-free expert-bias step; seq_aux_loss_coeff: weight of the per-sequence balance loss (0 disables);
    ce_chunk_size: tokens per cross-entropy chunk, so logits of at most this many tokens exist at once;
    indexer_tile_elements: elements (FP32: 4 bytes) one working tensor of the DSA
    indexer's tiled top-k and KL may hold; larger tiles mean fewer kernel launches (GPU), smaller ones less memory.
    """

    SECTION: ClassVar[str] = "loss"
    mtp_weight: float = 0.1
    indexer_kl_coeff: float = 1.0
    indexer_stage: str = "sparse"
    indexer_sparse_loss: bool = False
    router_bias_update_rate: float = 1e-3
    seq_aux_loss_coeff: float = 0.0
    ce_chunk_size: int = 4096
    indexer_tile_elements: int = 1 << 26

    def validate(self) -> None:
        for key in ("mtp_weight", "indexer_kl_coeff", "router_bias_update_rate", "seq_aux_loss_coeff"):
            value = getattr(self, key)
            self._require(math.isfinite(value) and value >= 0, key, "must be a finite number >= 0")
        self._choice("indexer_stage", ("sparse", "dense_warmup"))
        if self.indexer_sparse_loss and self.indexer_stage != "sparse":
            self._fail("indexer_sparse_loss", "applies only to loss.indexer_stage='sparse' "
                       f"(indexer_stage is {self.indexer_stage!r})")
        if self.indexer_stage == "dense_warmup" and self.indexer_kl_coeff <= 0:
            self._fail("indexer_kl_coeff", "must be > 0 in loss.indexer_stage='dense_warmup': the indexer KL is "
                       "the only trained objective there")
        self._require(self.ce_chunk_size >= 1, "ce_chunk_size", "must be >= 1")
        self._require(self.indexer_tile_elements >= 1, "indexer_tile_elements", "must be >= 1")


FSDP_RESHARD = ("default", "always", "never")


def reshard_after_forward(policy: str, *, head: bool) -> bool:
    """parallelism.fsdp_reshard_after_forward for one FSDP2 unit (the final norm + LM head unit, or another)."""
    return policy == "always" or (policy == "default" and not head)


@dataclass(frozen=True)
class ParallelismConfig(_Section):
    """[parallelism] Device mesh (TorchTitan's keys). The degrees multiply to the world size:
    data_parallel_replicate_degree x data_parallel_shard_degree x context_parallel_degree x tensor_parallel_degree.

    data_parallel_replicate_degree: HSDP replicas; data_parallel_shard_degree: FSDP2 shard degree, -1 = the rest;
    tensor_parallel_degree: heads / MLP columns split (DTensor); context_parallel_degree: sequence split (zigzag);
    expert_parallel_degree: routed experts split; borrows its ranks from data_parallel_shard x context_parallel, so
    it must divide their product and be a multiple of context_parallel_degree. expert_fsdp: under expert parallelism
    the ranks that hold the same experts (replicate x shard x cp / ep of them) each keep only their share of those
    experts' rows, parameters, gradients and optimizer states, as FSDP2 does for the rest of the model (the experts'
    op gathers them per layer); false keeps every rank's experts whole and all-reduces their gradients.
    fsdp_reshard_after_forward (TorchTitan's key): "default" frees each block's gathered parameters after its forward
    and gathers them again for its backward (the final norm + LM head stay gathered: their backward comes next);
    "always" frees the head's too; "never" keeps every unit gathered from its forward to its backward: one all-gather
    (on one GPU: one cast) less per block and step, for the compute-dtype copy of the parameters held meanwhile.
    fsdp_reduce_in_compute_pool: FSDP2's reduce outputs (the sharded gradients) allocated from the compute stream's
    allocator pool instead of the reduce-scatter stream's, so the previous step's gradients are reused by this
    step's activations and accumulated gradients rather than held apart (distributed/fsdp_comms.py); only where no
    parameter is split over ranks (data_parallel_shard x context_parallel = 1, no tensor or expert parallelism, no
    optimizer.cpu_offload). Unset (the default; "none" on the command line) turns it on exactly there, with a torch
    whose FSDP2 has set_custom_reduce_scatter (on one H200 the proxy at 8 rows per step reserved 113.3 GiB with it,
    where the planner puts it at 137.0 without: docs/performance.md, seventeenth session); true where it cannot apply
    is refused, false turns it off.
    """

    SECTION: ClassVar[str] = "parallelism"
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    expert_fsdp: bool = True
    fsdp_reshard_after_forward: str = "default"
    fsdp_reduce_in_compute_pool: bool | None = None

    def validate(self) -> None:
        self._choice("fsdp_reshard_after_forward", FSDP_RESHARD)
        self._require(self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
                      "data_parallel_shard_degree", "must be -1 (infer) or >= 1")
        for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "context_parallel_degree",
                    "expert_parallel_degree"):
            self._require(getattr(self, key) >= 1, key, "must be >= 1")


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# Roles a [float8] keep_bf16 entry may name (the blocks' `linear_roles`); routed experts have their own key.
FLOAT8_ROLES = ("kda", "mla", "indexer", "mlp", "shared_expert", "mtp")
SERVING_BF16_ROLES = ("indexer", "mla", "kda")


@dataclass(frozen=True)
class Float8Config(_Section):
    """[float8] FP8 training through torchao (float8.py), with the serving precision split.

    enable: convert at all; recipe: torchao Float8Linear recipe for the converted Linears ("tensorwise",
    "rowwise", "rowwise_with_gw_hp"); moe_experts: routed experts through torchao's FP8 rowwise grouped GEMM;
    fsdp_float8_all_gather: FSDP2 all-gathers the converted weights in FP8 (tensorwise only); keep_bf16: roles whose
    Linears stay BF16, default the serving split (the DSA indexer, the MLA attention GEMMs, every KDA projection),
    choose from kda, mla, indexer, mlp (the dense layers' MLPs), shared_expert, mtp (the MTP layer's projection).
    The LM head and the router are never converted; the routed experts follow moe_experts.
    """

    SECTION: ClassVar[str] = "float8"
    enable: bool = False
    recipe: str = "tensorwise"
    moe_experts: bool = True
    fsdp_float8_all_gather: bool = False
    keep_bf16: list[str] = field(default_factory=lambda: list(SERVING_BF16_ROLES))

    def validate(self) -> None:
        self._choice("recipe", FLOAT8_RECIPES)
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            self._fail("fsdp_float8_all_gather", f"needs float8.recipe='tensorwise' (torchao's FP8 all-gather uses "
                       f"one scale per tensor), recipe is {self.recipe!r}")
        for role in self.keep_bf16:
            if role == "experts":
                self._fail("keep_bf16", "routed experts are chosen by float8.moe_experts, not by keep_bf16")
            if role not in FLOAT8_ROLES:
                self._fail("keep_bf16", f"unknown role {role!r}; roles are {list(FLOAT8_ROLES)}")
        self._require(len(set(self.keep_bf16)) == len(self.keep_bf16), "keep_bf16", "has duplicates")

    def idle_keys(self) -> str:
        """A warning when a key asks for FP8 work while float8.enable is false (the key does nothing); empty
        otherwise. A warning, not an error: turning FP8 off on the command line should not need its keys undone."""
        if self.enable or not self.fsdp_float8_all_gather:
            return ""
        return "float8.fsdp_float8_all_gather = true does nothing while float8.enable is false: nothing is in FP8"


_HF_MODEL_TYPES = ("glm5_next", "glm5_next_text")


def hf_model_type_problem(path: str) -> str | None:
    """Why `path` (an HF checkpoint directory or config.json) is not a glm5_next model, or None if it is (or says
    nothing); checked before its keys are read as model arguments, whose errors would not say this."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"cannot read the HF config {file}: {e}"
    if not isinstance(hf, dict):
        return f"{file} is not an HF config (a JSON object)"
    model_type = hf.get("model_type")
    if model_type is not None and model_type not in _HF_MODEL_TYPES:
        return (f"{file} has model_type {model_type!r}: this is not a glm5_next checkpoint (expected model_type "
                f"{' or '.join(map(repr, _HF_MODEL_TYPES))})")
    return None


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    """[checkpoint] DCP checkpoints and HF import/export.

    enable: save checkpoints; folder: under job.dump_folder; interval: steps between saves; keep_latest_k: delete
    older step folders (0 keeps all); async_mode: "disabled" or "async" (DCP async_save); initial_load_path: weights
    to start from when the folder holds no checkpoint; initial_load_in_hf: that path is an HF safetensors checkpoint;
    last_save_in_hf: the final save is HF safetensors (needs enable); last_save_model_only: the final save is that HF
    export alone, no DCP step folder with the optimizer (TorchTitan's key; for a run whose last step only feeds
    serving or evaluation: a 7.95 B-parameter proxy's FP32 DCP state is ~47 GB, its BF16 export 16 GB);
    export_dtype: dtype of HF exports;
    export_fp8: the HF export uses the released FP8 layout (E4M3 + 128x128 block scales for what float8.keep_bf16
    does not keep, modules_to_not_convert for the rest) for serving: the routed experts are E4M3 there, as serving
    runs them, whether or not float8.moe_experts trained them in FP8;
    load_step: the checkpoint step to resume from (-1: the newest one that verifies; a corrupt or incomplete newer
    one is reported and skipped).
    """

    SECTION: ClassVar[str] = "checkpoint"
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500
    keep_latest_k: int = 0
    async_mode: str = "disabled"
    initial_load_path: str = ""
    initial_load_in_hf: bool = False
    last_save_in_hf: bool = False
    last_save_model_only: bool = False
    export_dtype: str = "bfloat16"
    export_fp8: bool = False
    load_step: int = -1

    def validate(self) -> None:
        self._require(bool(self.folder), "folder", "must be non-empty")
        self._require(self.interval >= 1, "interval", "must be >= 1")
        self._require(self.keep_latest_k >= 0, "keep_latest_k", "must be >= 0 (0 keeps all)")
        self._choice("async_mode", ("disabled", "async"))
        if self.initial_load_path:
            self._path_exists("initial_load_path", self.initial_load_path)
        if self.initial_load_in_hf and not self.initial_load_path:
            self._fail("initial_load_in_hf", "is true but checkpoint.initial_load_path is empty")
        if self.initial_load_in_hf:
            problem = hf_model_type_problem(self.initial_load_path)
            if problem:
                self._fail("initial_load_path", problem)
        self._require(self.load_step == -1 or self.load_step >= 1, "load_step", "must be -1 (newest) or >= 1")
        if self.last_save_in_hf and not self.enable:
            self._fail("last_save_in_hf", "is true but checkpoint.enable is false (nothing is saved)")
        if self.last_save_model_only and not self.last_save_in_hf:
            self._fail("last_save_model_only", "is true but checkpoint.last_save_in_hf is false (the model-only "
                       "final save is the HF export)")
        self._choice("export_dtype", _DTYPES)
        if self.export_fp8 and not self.last_save_in_hf:
            self._fail("export_fp8", "is true but checkpoint.last_save_in_hf is false (there is no HF export)")


@dataclass(frozen=True)
class ActivationCheckpointConfig(_Section):
    """[activation_checkpoint] (activation_checkpoint.py) mode: "none", "full" (recompute whole blocks) or "selective"
    (per-op policy: matmuls, attention and the KDA / DSA kernels saved, elementwise ops recomputed);
    recompute_modules (selective only): parts of each block whose saved ops are recomputed too, any of "kda" (the
    whole KDA token mixer), "mhc" (mHC maps and stream mixing), "indexer" (the DSA indexer: projections, top-k, KL),
    "mla_up_proj" (MLA q / kv up-projections), "sparse_attn" (the DSA attention kernel), "moe" (router, experts and
    shared expert), "mlp" (dense layers' MLP); Megatron's "moe_act" is accepted and is what selective already does.
    moe_chunk_tokens (any mode; 0 = off): the routed experts run over token chunks of this many tokens, each
    checkpointed, so backward holds one chunk's expert activations (long sequences; one more expert forward).
    offload_inputs (mode "full" only): what each checkpointed block keeps for backward, its inputs (the mHC
    streams, a shared DSA layer's token indices), waits in pinned host memory and is copied back for the recompute
    (a CPU run has nothing to move).
    kda_disable_recompute (any mode): FLA's disable_recompute for the KDA kernel: its forward keeps the WY factors,
    gated q / k, the new values and the chunk states, and its backward reuses them instead of recomputing them
    (less backward time; (3K + 2V) x 2 bytes more per token and head, plus K x V x 2 per 64-token chunk and head, in
    each KDA layer whose kernel outputs are kept: all of them without AC or under selective AC, one block's at a
    time under full AC or recompute_modules "kda"). CUDA only (the CPU backward differentiates the torch reference);
    needs data.document_masking = false (with document ids the count of chunk states depends on the documents, a
    shape the compiled graph cannot know) and context_parallel_degree = 1.
    """

    SECTION: ClassVar[str] = "activation_checkpoint"
    mode: str = "none"
    recompute_modules: list[str] = field(default_factory=list)
    moe_chunk_tokens: int = 0
    offload_inputs: bool = False
    kda_disable_recompute: bool = False

    def validate(self) -> None:
        from torchtitan_glm.activation_checkpoint import IMPLIED_BY_SELECTIVE, RECOMPUTE_MODULES

        self._require(self.moe_chunk_tokens >= 0, "moe_chunk_tokens", "must be >= 0 (0 = off)")

        self._choice("mode", ("none", "full", "selective"))
        for name in self.recompute_modules:
            if name not in RECOMPUTE_MODULES and name not in IMPLIED_BY_SELECTIVE:
                self._fail("recompute_modules", f"unknown module {name!r}; choose from {list(RECOMPUTE_MODULES)}")
        self._require(len(set(self.recompute_modules)) == len(self.recompute_modules), "recompute_modules",
                      "has duplicates")
        if self.offload_inputs and self.mode != "full":
            self._fail("offload_inputs", f"offloads what a full-AC block saves (its inputs), so it needs "
                       f"activation_checkpoint.mode = 'full', not {self.mode!r}")
        if self.recompute_modules and self.mode != "selective":
            self._fail("recompute_modules", f"{self.recompute_modules} refines mode 'selective' (what selective "
                       f"saves, these parts recompute), not mode {self.mode!r}: set "
                       "activation_checkpoint.mode = 'selective'")


@dataclass(frozen=True)
class CompileConfig(_Section):
    """[compile] torch.compile.

    enable: compile at all; backend: "inductor", "aot_eager" or "eager"; mode: torch.compile mode (inductor's:
    other backends take only "default"); components: what to compile, a non-empty subset of ["model", "loss"].
    """

    SECTION: ClassVar[str] = "compile"
    enable: bool = False
    backend: str = "inductor"
    mode: str = "default"
    components: list[str] = field(default_factory=lambda: ["model", "loss"])

    def validate(self) -> None:
        self._choice("backend", ("inductor", "aot_eager", "eager"))
        self._choice("mode", ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
        for c in self.components:
            if c not in ("model", "loss"):
                self._fail("components", f"unknown component {c!r}; choose from ['model', 'loss']")
        self._require(len(set(self.components)) == len(self.components), "components", "has duplicates")
        if self.enable and not self.components:
            self._fail("components", "is empty: nothing to compile; set compile.enable = false for eager")
        if self.enable and self.mode != "default" and self.backend != "inductor":
            self._fail("mode", f"{self.mode!r} is an inductor mode; with compile.backend = {self.backend!r} it would "
                               "be ignored: set compile.backend = 'inductor' or leave mode at 'default'")


@dataclass(frozen=True)
class MetricsConfig(_Section):
    """[metrics] Logging (components/metrics.py).

    log_freq: steps between console/tensorboard logs; enable_tensorboard: write TensorBoard events (rank 0);
    save_tb_folder: event folder under job.dump_folder.
    """

    SECTION: ClassVar[str] = "metrics"
    log_freq: int = 10
    enable_tensorboard: bool = False
    save_tb_folder: str = "tb"

    def validate(self) -> None:
        self._require(self.log_freq >= 1, "log_freq", "must be >= 1")
        self._require(bool(self.save_tb_folder), "save_tb_folder", "must be non-empty")


@dataclass(frozen=True)
class ProfilingConfig(_Section):
    """[profiling] torch.profiler over a window of training steps (components/profiling.py).

    enable: profile; start_step: the first profiled step (the steps before it warm up: compile, autotuning);
    steps: how many steps; trace_folder: under job.dump_folder, one Chrome trace per rank plus rank 0's table of the
    busiest kernels (ops.txt); row_limit: rows of that table. memory: record CUDA allocations with their Python
    stacks over the same window (with or without `enable`), and at its end (or at an out-of-memory inside it) write
    each rank's snapshot (memory_rank<r>_steps<a>-<b>.pickle, for pytorch.org/memory_viz) and rank 0's table of
    what was alive at the window's allocated peak by the source line that allocated it (memory.txt); CUDA only.
    start_step = 1 takes in the first step, where compile's peak is.
    """

    SECTION: ClassVar[str] = "profiling"
    enable: bool = False
    start_step: int = 10
    steps: int = 2
    trace_folder: str = "profile_trace"
    row_limit: int = 30
    memory: bool = False

    def validate(self) -> None:
        self._require(self.start_step >= 1, "start_step", "must be >= 1")
        self._require(self.steps >= 1, "steps", "must be >= 1")
        self._require(self.row_limit >= 1, "row_limit", "must be >= 1")
        self._require(bool(self.trace_folder), "trace_folder", "must be non-empty")


@dataclass(frozen=True)
class JobConfig:
    """The whole, validated, immutable run configuration: one attribute per TOML section."""

    job: JobSectionConfig = field(default_factory=JobSectionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def source_of(self, key: str) -> str:
        """Where `key`'s value came from (the command line, the config file, or the default), as load_config
        recorded it: for ConfigErrors found after loading (the layout against the world size, output folders)."""
        origins = self.__dict__.get("_origins", {})
        return origins.get(key, origins.get("", "default value"))

    def with_source(self, error: ConfigError) -> ConfigError:
        """`error` with the source of its key, unless it names one already."""
        return error if error.source else error.with_source(self.source_of(error.key))

    def validate(self) -> None:
        """Types, then each section's own rules, then the rules that span sections."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            for sf in dataclasses.fields(section):
                value, tp = getattr(section, sf.name), _field_types(type(section))[sf.name]
                if tp is dict:  # extra keys ([model] args): each checked against its own type
                    extra = type(section).extra_keys()
                    for k, v in value.items():
                        if k not in extra:
                            raise ConfigError(f"{f.name}.{k}", "unknown key")
                        _check_type(v, extra[k], f"{f.name}.{k}")
                else:
                    _check_type(value, tp, f"{f.name}.{sf.name}")
            section.validate()
        tr, lr = self.training, self.lr_scheduler
        if lr.warmup_steps > tr.steps:
            raise ConfigError("lr_scheduler.warmup_steps",
                              f"{lr.warmup_steps} warmup steps exceed training.steps={tr.steps}")
        if lr.decay_type == "wsd":
            decay_steps = round(lr.decay_ratio * tr.steps)
            if decay_steps < 1 or lr.warmup_steps + decay_steps > tr.steps:
                raise ConfigError("lr_scheduler.decay_ratio",
                                  f"wsd decay of round({lr.decay_ratio} * training.steps={tr.steps}) = {decay_steps} "
                                  f"steps must be >= 1 and fit after lr_scheduler.warmup_steps={lr.warmup_steps}")
        args = self.model.model_args()
        if tr.seq_len > args.max_position_embeddings:
            raise ConfigError("training.seq_len", f"{tr.seq_len} tokens per row exceed the model's "
                              f"max_position_embeddings={args.max_position_embeddings} (model.max_position_embeddings)")
        if self.loss.mtp_weight == 0 and self.model.args.get("num_nextn_predict_layers", 0) > 0:
            raise ConfigError("model.num_nextn_predict_layers",
                              f"{self.model.args['num_nextn_predict_layers']} MTP layer(s) asked for, but "
                              "loss.mtp_weight = 0 trains without the MTP layer (the trainer drops it): set "
                              "loss.mtp_weight > 0, or leave model.num_nextn_predict_layers out")
        if self.activation_checkpoint.kda_disable_recompute:
            if self.data.document_masking:
                raise ConfigError("activation_checkpoint.kda_disable_recompute",
                                  "needs data.document_masking = false: with document ids FLA's saved chunk states "
                                  "number one per 64-token chunk of each document, a count the compiled graph cannot "
                                  "know in advance")
            if self.parallelism.context_parallel_degree > 1:
                raise ConfigError("activation_checkpoint.kda_disable_recompute",
                                  f"needs parallelism.context_parallel_degree = 1, not "
                                  f"{self.parallelism.context_parallel_degree} (FLA's context-parallel KDA path "
                                  "recomputes its states)")
        prof = self.profiling
        if (prof.enable or prof.memory) and prof.start_step + prof.steps - 1 > tr.steps:
            raise ConfigError("profiling.start_step",
                              f"steps {prof.start_step}..{prof.start_step + prof.steps - 1} (profiling.steps="
                              f"{prof.steps}) end after training.steps={tr.steps}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sections as TOML tables; extra keys (the [model] args) appear as plain keys of their section."""
        out = {}
        for f in dataclasses.fields(self):
            values = dataclasses.asdict(getattr(self, f.name))
            for k, tp in _field_types(type(getattr(self, f.name))).items():
                if tp is dict:
                    values.update(values.pop(k))
            out[f.name] = values
        return out

    def to_toml(self) -> str:
        """TOML text that load_config reads back to an equal JobConfig."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
            lines.append("")
        return "\n".join(lines)


_SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------- typing
@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _optional_inner(tp: Any) -> Any | None:
    """X for Optional[X] / X | None, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_name(inner)} or none"
    if typing.get_origin(tp) is list:
        return "list of strings"
    return {bool: "bool (true/false)", int: "integer", float: "number", str: "string"}.get(tp, str(tp))


def _check_type(value: Any, tp: Any, key: str) -> None:
    inner = _optional_inner(tp)
    if inner is not None:
        if value is not None:
            _check_type(value, inner, key)
        return
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(tp, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))(value)
    if not ok:
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _from_toml(value: Any, tp: Any, key: str) -> Any:
    _check_type(value, tp, key)
    return float(value) if tp is float else value


def _from_cli(text: str, tp: Any, key: str) -> Any:
    inner = _optional_inner(tp)
    if inner is not None:
        if text.strip().lower() in ("", "none", "null"):
            return None
        try:
            return _from_cli(text, inner, key)
        except ConfigError:  # name the whole type: "none" is a value too
            raise ConfigError(key, f"expected {_type_name(tp)}, got {text!r}") from None
    if tp not in (bool, int, float, str) and text.strip().startswith("["):  # a TOML array: ["kda", "mhc"]
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(key, f"expected a TOML array of strings or comma-separated strings, got {text!r} "
                                   f"({e})") from None
        _check_type(value, tp, key)
        return value
    try:
        if tp is bool:
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is str:
            return text
        return [s.strip() for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(key, f"expected {_type_name(tp)}, got {text!r}") from None


def _toml_value(v: Any) -> str:
    if v is None:  # unset (only --help shows it: TOML has no null, so --print-config leaves such keys out)
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


# --------------------------------------------------------------------------------------------------- loading
def _lookup(section: str, key: str | None, source: str) -> Any:
    """The field type of section.key; ConfigError (with suggestions) for unknown names."""
    if section not in _SECTIONS:
        close = difflib.get_close_matches(section, _SECTIONS, n=1)
        hint = f"; did you mean [{close[0]}]?" if close else f"; known sections: {sorted(_SECTIONS)}"
        raise ConfigError(section, f"unknown section [{section}]{hint}", source)
    types_ = {k: tp for k, tp in _field_types(_SECTIONS[section]).items() if tp is not dict}
    types_.update(_SECTIONS[section].extra_keys())
    derived = getattr(_SECTIONS[section], "DERIVED_KEYS", {})
    if key in derived:
        raise ConfigError(f"{section}.{key}", derived[key], source)
    if key is not None and key not in types_:
        close = difflib.get_close_matches(key, types_, n=1)
        hint = f"; did you mean `{section}.{close[0]}`?" if close else f"; known keys: {sorted(types_)}"
        raise ConfigError(f"{section}.{key}", f"unknown key{hint}", source)
    return types_.get(key) if key is not None else None


def _parse_argv(argv: list[str]) -> tuple[str | None, bool, bool | str, list[tuple[str, str | None]]]:
    """Split argv into (config path, --print-config, --help (True, or the SECTION of `--help SECTION`), [(dotted
    key, raw value or None for a bare flag)])."""
    config_path, print_config, want_help, overrides = None, False, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            want_help = True
            if i < len(argv) and not argv[i].startswith("-"):  # --help SECTION
                want_help, i = argv[i], i + 1
            continue
        if arg == "--print-config":
            print_config = True
            continue
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(arg, "unexpected command-line argument (expected --config PATH or --section.key VALUE)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            else:
                value = None
        if name == "config":
            if value is None:
                raise ConfigError("--config", "needs a path")
            config_path = value
        elif "." in name:
            overrides.append((name, value))
        else:
            raise ConfigError(arg, "unknown option; overrides look like --section.key VALUE")
    return config_path, print_config, want_help, overrides


def _help_text(section_only: str | None = None) -> str:
    """Every key with its type and default, each section headed by its docstring's first line; for `section_only`
    the section's whole docstring (what each key means) above its keys."""
    if section_only is not None and section_only not in _SECTIONS:
        close = difflib.get_close_matches(section_only, list(_SECTIONS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError("--help", f"unknown section {section_only!r}{hint}; sections are {list(_SECTIONS)}")
    lines = ["usage: train.py [--config FILE.toml] [--print-config] [--section.key VALUE | --section.key=VALUE]...",
             "       train.py --help SECTION   (what each key of [SECTION] means)", ""]
    for section, cls in _SECTIONS.items():
        if section_only is not None and section != section_only:
            continue
        doc = inspect.cleandoc(cls.__doc__ or "")
        if section_only is not None:
            lines += [doc, "", f"[{section}]"]
        else:
            first = doc.splitlines()[0] if doc else ""
            lines.append(first if first.startswith(f"[{section}]") else f"[{section}]  {first}".rstrip())
        default = cls()
        for name, tp in _field_types(cls).items():
            if tp is dict:
                lines += [f"  --{section}.{k} ({_type_name(t)}, default from the flavor)"
                          for k, t in cls.extra_keys().items()]
                continue
            lines.append(f"  --{section}.{name} ({_type_name(tp)}, default {_toml_value(getattr(default, name))})")
    return "\n".join(lines)


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Parse `--config path.toml`, `--print-config` and `--section.key value` overrides into a validated JobConfig.

    `--print-config` checks the merged config and prints it as TOML: exit 0 when valid; an invalid config prints
    nothing and raises its ConfigError, except one that fails on a file this host lacks (a config for another
    machine, e.g. its data paths), which prints, then raises. `--help` lists every key and exits 0 (`--help SECTION`:
    that section's description too).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, print_config, want_help, overrides = _parse_argv(argv)
    if want_help:
        print(_help_text(want_help if isinstance(want_help, str) else None))
        raise SystemExit(0)
    file_note = f"config file {config_path}" if config_path else None
    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    origin: dict[str, str] = {}

    if config_path is not None:
        try:
            with open(config_path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as e:
            raise ConfigError("--config", f"cannot read {config_path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"{config_path} is not valid TOML: {e}") from None
        for section, table in raw.items():
            _lookup(section, None, file_note)
            if not isinstance(table, dict):
                raise ConfigError(section, f"expected a table [{section}], got {table!r}", file_note)
            for key, value in table.items():
                tp = _lookup(section, key, file_note)
                try:
                    values[section][key] = _from_toml(value, tp, f"{section}.{key}")
                except ConfigError as e:
                    raise e.with_source(file_note) from None
                origin[f"{section}.{key}"] = file_note

    for dotted, text in overrides:
        section, _, key = dotted.partition(".")
        cli_note = f"command line --{dotted}" + (f"; {file_note}" if file_note else "")
        tp = _lookup(section, key, cli_note)
        if text is None:
            if tp is not bool:
                raise ConfigError(dotted, f"needs a value ({_type_name(tp)})", cli_note)
            text = "true"
        try:
            values[section][key] = _from_cli(text, tp, dotted)
        except ConfigError as e:
            raise e.with_source(cli_note) from None
        origin[dotted] = cli_note

    cfg = JobConfig(**{s: cls(**_pack_extra(cls, values[s])) for s, cls in _SECTIONS.items()})
    default_note = "default value" + (f"; {file_note}" if file_note else "")
    object.__setattr__(cfg, "_origins", {**origin, "": default_note})  # not a field: the config is what it holds
    try:
        cfg.validate()
    except ConfigError as e:
        if print_config and e.host:  # a config for another machine (its data paths) still shows
            print(cfg.to_toml(), end="")
            sys.stdout.flush()
        raise cfg.with_source(e) from None
    if print_config:
        print(cfg.to_toml(), end="")
        sys.stdout.flush()
        raise SystemExit(0)
    return cfg


def _pack_extra(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """Move a section's extra keys into its dict field (the [model] args)."""
    dict_fields = [k for k, tp in _field_types(cls).items() if tp is dict]
    if not dict_fields:
        return values
    own = set(_field_types(cls))
    packed = {k: v for k, v in values.items() if k in own}
    packed[dict_fields[0]] = {k: v for k, v in values.items() if k not in own}
    return packed


QUIET_RANK_WAIT_S = 30.0  # main_guard: how long a non-printing rank waits for torchrun to stop it


def main_guard(fn: Callable[..., T]) -> Callable[..., T]:
    """Wrap an entry point: a ConfigError prints one line to stderr and exits with code 2.

    Call load_config first thing inside `fn`, before any process group starts, so every rank fails the same way.
    Under torchrun only each host's first process (LOCAL_RANK 0) prints the line, once per host rather than once per
    rank; every process exits 2. torchrun stops the other workers when the first one exits, so a quiet rank that
    exited before the printing one had printed silenced the line (seen on a loaded CI machine): under torchrun the
    quiet ranks wait, at most QUIET_RANK_WAIT_S seconds, for torchrun to stop them once the printing rank exits.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr)
                sys.stderr.flush()
            elif "TORCHELASTIC_RUN_ID" in os.environ:
                time.sleep(QUIET_RANK_WAIT_S)
        raise SystemExit(2)

    return wrapper
