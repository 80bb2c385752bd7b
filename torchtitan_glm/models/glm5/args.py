"""Glm5ModelArgs: every text-model key of GLM-5.3-Flash's config.json, named flavors, and HF config parsing."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

KDA = "linear_attention"
DSA = "indexed_attention"
# Names the released configs and HF use for the DSA layers; all mean the same block.
_DSA_ALIASES = {"indexed_attention", "full_attention", "deepseek_sparse_attention"}
_MLP_TYPES = {"dense", "sparse"}
_INDEXER_TYPES = {"full", "shared"}


# Glm5ModelArgs fields that are trainer-side choices, never written to or read from config.json.
TRAINER_FIELDS = ("hc_head", "dsa_attention", "indexer_fp8_emulation", "mhc_fp32_mixing", "kpool_fp32_accumulate",
                  "indexer_weights_fp32", "indexer_k_norm_fp32", "kpool_ape_trainable", "indexer_tile_elements",
                  "dsa_dense_max_len", "dsa_mask_query_chunk", "dsa_mask_causal_rows")


class ModelArgsError(ValueError):
    """An invalid or unsupported model configuration; the message names the key (also in `.key`)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class Glm5ModelArgs:
    """Hyper-parameters of the GLM-5.3-Flash text model (HF `Glm5NextTextConfig` keys, same names and defaults)."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 154820
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mla_use_nope: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_router_dtype: str = "float32"
    first_k_dense_replace: int = 3
    mlp_layer_types: list[str] | None = None
    layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    # DSA indexer (KPool)
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 4
    index_kpool_compress: bool = True
    index_kpool_always_select_tail: bool = True
    indexer_rope_interleave: bool = True  # vestigial: GLM-5.3-Flash has no RoPE
    index_share_for_mtp_iteration: bool = True
    # SwiGLU clamp
    swiglu_limit: float = 10.0
    # KDA (linear_attn_config)
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    # mHC
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # MoE aux loss coefficient of the HF config (the trainer's own knob lives in [loss])
    router_aux_loss_coef: float = 0.001
    # MTP
    num_nextn_predict_layers: int = 1
    # Trainer-side choices that are not in config.json (TRAINER_FIELDS). The precision controls follow the
    # Megatron-LM GLM-5.3 PR (NVIDIA/Megatron-LM#7522); each defaults to what the transformers reference computes.
    hc_head: str = "mean"  # "mean" (GLM-5.3-Flash) or "learned" (DeepSeek-V4 style hc_head_* contraction)
    dsa_attention: str = "sparse"  # "sparse" (top-k) or "dense" (dense causal; indexer warm-up stage)
    # Serving's FP8 indexer inputs: Hadamard-rotate the indexer query and the pooled keys, E4M3 with power-of-two
    # row scales, dequantise (straight-through gradient), so training's top-k sees what serving's does.
    indexer_fp8_emulation: bool = False
    mhc_fp32_mixing: bool = False  # mHC residual mixing (post/comb applied to the streams) in FP32, one final cast
    kpool_fp32_accumulate: bool = False  # KPool weighted sum in FP32, one rounding of the pooled key
    indexer_weights_fp32: bool = False  # indexer head-weight projection (weights_proj) computed in FP32
    indexer_k_norm_fp32: bool = False  # indexer key LayerNorm computed in FP32 (FP32 weight and bias)
    kpool_ape_trainable: bool = True  # KPool APE receives gradients (the PR freezes it)
    # Elements one working tensor of the DSA indexer's tiled top-k and KL may hold (loss.indexer_tile_elements).
    indexer_tile_elements: int = 1 << 26
    # Sparse stage, rows of at most this many tokens (the whole row under context parallelism): the selected set
    # is attended with dense masked SDPA under a [T, T] mask made from the indices, not the gathered sparse kernel.
    # The same function; at short T the dense kernel is faster (H200, one proxy DSA layer fwd+bwd: 0.55x the sparse
    # op's time at T = 4,096, 1.04x at 8,192; docs/performance.md). 0: always the sparse kernel.
    dsa_dense_max_len: int = 0
    # That masked SDPA (and the dense stage's) in query chunks of this many rows, each over the keys up to its last
    # query: (n + 1) / (2n) of the T x T pairs for n chunks, the same function (ops/masked_attention.py). 0: one call.
    dsa_mask_query_chunk: int = 1024
    # One document per row (no doc_ids) and no context parallelism: the dense stage, and the first
    # index_topk + index_kpool - 1 queries of a short sparse-stage row (whose selection still holds every past
    # token), run SDPA's causal kernel with no mask. The same function (ops/masked_attention.py).
    dsa_mask_causal_rows: bool = True

    def dense_dsa_kernel(self, seq_len: int) -> bool:
        """Whether DSA attention over rows of `seq_len` tokens runs dense masked SDPA (the dense warm-up stage, or
        a sparse-stage row no longer than dsa_dense_max_len)."""
        return self.dsa_attention == "dense" or seq_len <= self.dsa_dense_max_len

    def causal_dsa_rows(self, seq_len: int) -> int:
        """Of a one-document row of `seq_len` tokens on the dense kernel (no doc_ids, no context parallelism), the
        leading rows that run SDPA's causal kernel with no mask: all of them in the dense stage; in the sparse stage
        those whose selection still holds every past token (query t has t + 1, and the K = index_topk + kpool - 1
        slots take every complete pool, then the incomplete tail; without the tail the query's own incomplete pool
        is left out, so none is plain causal)."""
        if not self.dsa_mask_causal_rows:
            return 0
        if self.dsa_attention == "dense":
            return seq_len
        tail = self.index_kpool_always_select_tail or self.index_kpool == 1
        return min(self.index_topk + self.index_kpool - 1, seq_len) if tail else 0

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [DSA if i % 4 == 3 else KDA for i in range(n)]
        if self.mlp_layer_types is None:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        self.layer_types = [DSA if t in _DSA_ALIASES else t for t in self.layer_types]
        self.layer_types = list(self.layer_types)
        self.mlp_layer_types = list(self.mlp_layer_types)
        self.indexer_types = list(self.indexer_types)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def num_dsa_layers(self) -> int:
        return sum(t == DSA for t in self.layer_types)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ModelArgsError naming the key for any combination the model cannot run."""
        n = self.num_hidden_layers

        def fail(key: str, msg: str) -> None:
            raise ModelArgsError(f"model arg `{key}`: {msg}", key=key)

        for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "n_shared_experts", "n_routed_experts", "kv_lora_rank", "v_head_dim",
                    "qk_nope_head_dim", "max_position_embeddings", "linear_num_heads", "linear_head_dim",
                    "linear_conv_kernel_dim", "index_topk", "index_n_heads", "index_head_dim", "hc_mult",
                    "hc_sinkhorn_iters", "n_group"):
            if int(getattr(self, key)) < 1:
                fail(key, f"must be >= 1, got {getattr(self, key)}")
        if self.first_k_dense_replace < 0:
            fail("first_k_dense_replace", f"must be >= 0, got {self.first_k_dense_replace}")
        for key in ("rms_norm_eps", "hc_eps", "routed_scaling_factor", "swiglu_limit"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                fail(key, f"must be a finite number > 0, got {value}")
        for key in ("initializer_range", "router_aux_loss_coef"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                fail(key, f"must be a finite number >= 0, got {value}")
        # Carried from config.json; the model implements only these (the router always computes in FP32).
        if self.topk_method != "noaux_tc":
            fail("topk_method", f"only 'noaux_tc' routing is supported, got {self.topk_method!r}")
        for key in ("index_kpool_compress", "index_share_for_mtp_iteration"):
            if not getattr(self, key):  # GLM-5.3-Flash's values; transformers' glm5_next has no other path either
                fail(key, "only true is implemented (the GLM-5.3-Flash value)")
        if self.moe_router_dtype != "float32":
            fail("moe_router_dtype", f"the router computes in float32 only, got {self.moe_router_dtype!r}")
        for key, values in (("layer_types", self.layer_types), ("mlp_layer_types", self.mlp_layer_types),
                            ("indexer_types", self.indexer_types)):
            if len(values) != n:
                fail(key, f"has {len(values)} entries but num_hidden_layers is {n}")
        for i, t in enumerate(self.layer_types):
            if t not in (KDA, DSA):
                fail("layer_types", f"unknown layer type {t!r} at layer {i} (expected 'linear_attention' or "
                     "'indexed_attention'/'deepseek_sparse_attention')")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in _MLP_TYPES:
                fail("mlp_layer_types", f"unknown mlp type {t!r} at layer {i} (expected 'dense' or 'sparse')")
        for i, t in enumerate(self.indexer_types):
            if t not in _INDEXER_TYPES:
                fail("indexer_types", f"unknown indexer type {t!r} at layer {i} (expected 'full' or 'shared')")
            if t == "shared" and self.layer_types[i] == DSA:
                if i == 0 or self.layer_types[i - 1] != DSA:
                    fail("indexer_types", f"layer {i} is 'shared' but layer {i - 1} is not an indexed_attention "
                         "layer whose selection it could reuse")
        if self.index_kpool < 1:
            fail("index_kpool", f"must be >= 1, got {self.index_kpool}")
        if self.index_topk % self.index_kpool != 0:
            fail("index_topk", f"{self.index_topk} is not divisible by index_kpool={self.index_kpool}")
        if self.qk_rope_head_dim != 0:
            fail("qk_rope_head_dim", f"GLM-5.3-Flash DSA layers are NoPE; got {self.qk_rope_head_dim} (must be 0)")
        if not self.mla_use_nope:
            fail("mla_use_nope", "only NoPE MLA is supported (must be true)")
        if self.num_key_value_heads != self.num_attention_heads:
            fail("num_key_value_heads", f"must equal num_attention_heads ({self.num_attention_heads}) for MLA")
        if self.q_lora_rank is None or self.q_lora_rank < 1:
            fail("q_lora_rank", "DSA needs the query latent (q_lora_rank >= 1)")
        if self.hidden_act != "silu":
            fail("hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        if self.scoring_func != "sigmoid":
            fail("scoring_func", f"only 'sigmoid' routing is supported, got {self.scoring_func!r}")
        if self.n_routed_experts % self.n_group != 0:
            fail("n_group", f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            fail("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            fail("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            fail("n_group", "group-limited routing needs at least 2 experts per group")
        if self.linear_lower_bound is not None and not self.linear_lower_bound < 0:
            fail("linear_lower_bound", f"must be negative (a decay bound), got {self.linear_lower_bound}")
        if self.indexer_fp8_emulation and self.index_head_dim & (self.index_head_dim - 1):
            fail("indexer_fp8_emulation", f"the Hadamard rotation needs a power-of-two index_head_dim, got "
                 f"{self.index_head_dim}")
        if self.indexer_tile_elements < 1:
            fail("indexer_tile_elements", f"must be >= 1, got {self.indexer_tile_elements}")
        if self.dsa_dense_max_len < 0:
            fail("dsa_dense_max_len", f"must be >= 0 (0: always the sparse kernel), got {self.dsa_dense_max_len}")
        if self.dsa_mask_query_chunk < 0:
            fail("dsa_mask_query_chunk", f"must be >= 0 (0: one masked SDPA call), got {self.dsa_mask_query_chunk}")
        if self.hc_head not in ("mean", "learned"):
            fail("hc_head", f"must be 'mean' or 'learned', got {self.hc_head!r}")
        if self.dsa_attention not in ("sparse", "dense"):
            fail("dsa_attention", f"must be 'sparse' or 'dense', got {self.dsa_attention!r}")
        if self.num_nextn_predict_layers not in (0, 1):
            fail("num_nextn_predict_layers",
                 f"only 0 or 1 MTP layers are supported, got {self.num_nextn_predict_layers}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            fail("pad_token_id", f"{self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict[str, Any], **overrides: Any) -> "Glm5ModelArgs":
        """Build args from an HF config (a dict, a config.json path, or a checkpoint directory).

        Accepts the flat text-only form and the multimodal form with the text keys under `text_config`.
        Keys that are not text-model keys (vision, token ids, quantization) are ignored.
        """
        if isinstance(path_or_dict, dict):
            cfg = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path) as f:
                    cfg = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ModelArgsError(f"cannot read HF config {path}: {e}") from e
        if isinstance(cfg.get("text_config"), dict):
            cfg = dict(cfg["text_config"])
        lac = cfg.pop("linear_attn_config", None)
        if isinstance(lac, dict):
            renames = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                       "short_conv_kernel_size": "linear_conv_kernel_dim", "gate_lower_bound": "linear_lower_bound"}
            for src, dst in renames.items():
                if src in lac:
                    cfg[dst] = lac[src]
            if lac.get("safe_gate", True) and cfg.get("linear_lower_bound", -5.0) is None:
                cfg["linear_lower_bound"] = -5.0
        if "num_nextn_predict_layers" not in cfg:
            cfg["num_nextn_predict_layers"] = cls.num_nextn_predict_layers
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if k in names}
        kwargs.pop("head_dim", None)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """The flat text config.json dict that `from_hf_config` reads back (model_type glm5_next_text): the trainer's
        own fields left out, except a non-default hc_head, which changes the parameters."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in TRAINER_FIELDS:
            out.pop(k)
        if self.hc_head != "mean":  # adds parameters, so a checkpoint must say so (absent: the released "mean")
            out["hc_head"] = self.hc_head
        out["head_dim"] = self.qk_rope_head_dim
        out["model_type"] = "glm5_next_text"
        out["architectures"] = ["Glm5NextTextModel"]
        return out

    def replace(self, **changes: Any) -> "Glm5ModelArgs":
        return dataclasses.replace(self, **changes)


def _debug() -> Glm5ModelArgs:
    # Tiny: trains on 2 CPU cores in seconds. Vocab fits the built-in byte tokenizer (256 bytes + specials).
    return Glm5ModelArgs(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=16,
        index_n_heads=4, index_kpool=4, linear_num_heads=4, linear_head_dim=16, hc_mult=4, pad_token_id=None,
        first_k_dense_replace=1, layer_types=[KDA, KDA, KDA, DSA],
    )


# The real head shapes' crossover between dense masked SDPA and the sparse kernel on the H200 lies between
# T = 4,096 (dense 0.55x the sparse time) and 8,192 (1.04x): rows up to 6,144 tokens take the dense kernel.
_DENSE_DSA_MAX_LEN = 6144


def _full() -> Glm5ModelArgs:
    return Glm5ModelArgs(dsa_dense_max_len=_DENSE_DSA_MAX_LEN)


def _proxy() -> Glm5ModelArgs:
    # One-H200 proxy of measured_h200.md: real head shapes, 8 layers (2 DSA), 32 experts.
    return Glm5ModelArgs(num_hidden_layers=8, n_routed_experts=32, dsa_dense_max_len=_DENSE_DSA_MAX_LEN)


FLAVORS = {"debug": _debug, "glm5_3_flash": _full, "glm5_3_flash_proxy": _proxy}


def get_flavor(name: str) -> Glm5ModelArgs:
    """A fresh Glm5ModelArgs for a named flavor."""
    if name not in FLAVORS:
        raise ModelArgsError(f"model flavor {name!r} is unknown; choose one of {sorted(FLAVORS)}")
    return FLAVORS[name]()
