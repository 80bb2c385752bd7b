"""KDA (Kimi Delta Attention) block: projections, short convs, low-rank decay and output gates, chunked gated delta
rule."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_glm.ops.causal_conv import causal_conv_silu
from torchtitan_glm.ops.kda import kda as kda_op
from torchtitan_glm.ops.kda_cp import conv_halo, kda_cp
from torchtitan_glm.ops.kda_decode import kda_prefill, kda_step

from .args import Glm5ModelArgs
from .batch import BatchLayout
from .cache import KDACache
from .gated_norm import gated_rms_norm
from .kda_gate import kda_log_decay
from .layers import init_linear, local_param


class ShortConv(nn.Module):
    """Depthwise causal conv (kernel W) + SiLU, in FP32, restarted at document boundaries (ops/causal_conv.py):
    a tap that reaches into the previous document reads zero."""

    keep_fp32 = True

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=torch.float32))

    def forward(self, x: torch.Tensor, pos_in_doc: torch.Tensor | None,
                halo: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C]; pos_in_doc [B, T] (None: one document per row). Under context parallelism the local T
        holds P slots of the row that are not adjacent, and halo [B, P, W-1, C] (ops.kda_cp.conv_halo) holds the
        W-1 tokens before each slot; pos_in_doc is then the position in the (global) document."""
        # [C, W]; tap W-1 multiplies x_t, W-1-j x_{t-j}; the op computes in FP32 whatever the weight's dtype
        return causal_conv_silu(x, local_param(self.weight).squeeze(1), pos_in_doc, halo)

    def init_weights(self, *, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)


class KDADecay(nn.Module):
    """FP32 decay parameters: A_log [H] and dt_bias [H*K] (kept FP32, no weight decay)."""

    keep_fp32 = True
    no_weight_decay = True

    def __init__(self, num_heads: int, head_dim: int, *, lower_bound: float | None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.lower_bound = lower_bound
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(num_heads * head_dim, dtype=torch.float32))

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay [B, T, H, K] in FP32 from the low-rank gate output f [B, T, H*K]."""
        # kda_gate.py; the heads: this rank's under TP
        return kda_log_decay(f, local_param(self.A_log), local_param(self.dt_bias), head_dim=self.head_dim,
                             lower_bound=self.lower_bound)

    def init_weights(self) -> None:
        # FLA/reference convention: A_log = 0 for the bounded ("safe") gate, else log U(1, 16);
        # dt_bias = inverse softplus of dt ~ logU(1e-3, 1e-1).
        if self.lower_bound is not None:
            nn.init.zeros_(self.A_log)
        else:
            with torch.no_grad():
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        with torch.no_grad():
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm in FP32 times sigmoid(gate), one cast at the end (gated_norm.py)."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, local_param(self.weight), eps=self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class KimiDeltaAttention(nn.Module):
    """KDA token mixer (34 of GLM-5.3-Flash's 45 layers). Serving runs its projections in BF16."""

    # Projection roles for the precision filters: every KDA Linear stays BF16 in the serving split.
    linear_roles = {name: "kda" for name in
                    ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj", "o_proj")}

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        d, h, k = args.hidden_size, args.linear_num_heads, args.linear_head_dim
        self.num_heads, self.head_dim = h, k
        self.init_std = args.initializer_range
        inner = h * k
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.k_proj = nn.Linear(d, inner, bias=False)
        self.v_proj = nn.Linear(d, inner, bias=False)
        self.q_conv1d = ShortConv(inner, args.linear_conv_kernel_dim)
        self.k_conv1d = ShortConv(inner, args.linear_conv_kernel_dim)
        self.v_conv1d = ShortConv(inner, args.linear_conv_kernel_dim)
        self.f_a_proj = nn.Linear(d, k, bias=False)
        self.f_b_proj = nn.Linear(k, inner, bias=False)
        self.decay = KDADecay(h, k, lower_bound=args.linear_lower_bound)
        self.b_proj = nn.Linear(d, h, bias=False)
        self.g_a_proj = nn.Linear(d, k, bias=False)
        self.g_b_proj = nn.Linear(k, inner, bias=False)
        self.o_norm = GatedRMSNorm(k, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(inner, d, bias=False)
        # FLA's safe-gate kernel path needs gates in [-5, 0): true for a lower bound in [-5, 0).
        lb = args.linear_lower_bound
        self.safe_gate = lb is not None and -5.0 <= lb < 0
        # set by activation_checkpoint.py from activation_checkpoint.kda_disable_recompute, never by hand: the KDA
        # op keeps FLA's forward intermediates for its backward (ops/kda.py::kda, save_states)
        self.save_states = False

    def forward(self, x: torch.Tensor, batch: BatchLayout) -> torch.Tensor:
        """x [B, T_local, D]; documents restart the state and the short convs; under context parallelism the state
        is chained across the cp ranks and the convs take their halo from the preceding slots."""
        heads = (-1, self.head_dim)  # all heads, or this rank's under tensor parallelism
        pos = None if batch.doc_ids is None else batch.doc.pos
        cp = batch.cp
        qkv = []
        for proj, conv in ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d)):
            h = proj(x)
            halo = None if cp is None else conv_halo(h, conv.kernel_size, group=cp.group)
            qkv.append(conv(h, pos, halo).unflatten(-1, heads))
        q, k, v = qkv
        g = self.decay(self.f_b_proj(self.f_a_proj(x)))
        beta = torch.sigmoid(self.b_proj(x))
        if cp is None:
            o = kda_op(q, k, v, g, beta, batch.kda_seq_idx, safe_gate=self.safe_gate, save_states=self.save_states)
        elif self.save_states:
            raise ValueError("activation_checkpoint.kda_disable_recompute does not apply under context parallelism "
                             "(FLA's CP path recomputes its states)")
        else:
            o = kda_cp(q, k, v, g, beta, batch.doc_ids, group=cp.group, layout="zigzag", safe_gate=self.safe_gate)
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, heads)
        return self.o_proj(self.o_norm(o, gate).flatten(-2))

    def init_weights(self) -> None:
        for name in self.linear_roles:
            init_linear(getattr(self, name), std=self.init_std)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.init_weights(std=self.init_std)
        self.decay.init_weights()
        self.o_norm.init_weights()

    # ------------------------------------------------------------------ decode (models/glm5/decode.py)
    def prefill(self, x: torch.Tensor, batch: BatchLayout) -> tuple[torch.Tensor, KDACache]:
        """forward()'s output for rows that each end with a prompt (left padding as a document before it), and the
        cache after each row's last token: the state of the chunked scan and the short convs' last W - 1 inputs."""
        if batch.cp is not None:
            raise NotImplementedError("KDA prefill under context parallelism")
        heads = (-1, self.head_dim)
        pos = None if batch.doc_ids is None else batch.doc.pos
        qkv, tails = [], []
        for proj, conv in ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d)):
            h = proj(x)
            qkv.append(conv(h, pos).unflatten(-1, heads))
            width = conv.kernel_size - 1
            tails.append(F.pad(h[:, -width:] if width else h[:, :0], (0, 0, max(0, width - h.shape[1]), 0)))
        g = self.decay(self.f_b_proj(self.f_a_proj(x)))
        beta = torch.sigmoid(self.b_proj(x))
        o, state = kda_prefill(*qkv, g, beta, batch.kda_seq_idx, self.safe_gate)  # host ids: no copy per layer
        return self._gated_output(o, x), KDACache(state, tails)

    def decode(self, x: torch.Tensor, cache: KDACache, pos: torch.Tensor) -> torch.Tensor:
        """One token per row: x [B, 1, D] at prompt positions pos [B]; advances `cache` in place. The short convs
        take the cached tokens as their halo (taps before the prompt's start are masked by the position)."""
        heads = (-1, self.head_dim)
        qkv = []
        for i, (proj, conv) in enumerate(((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d),
                                          (self.v_proj, self.v_conv1d))):
            h = proj(x)
            qkv.append(conv(h, pos.unsqueeze(1), cache.conv[i].unsqueeze(1)).unflatten(-1, heads))
            cache.conv[i] = torch.cat([cache.conv[i], h.to(cache.conv[i].dtype)], dim=1)[:, 1:]
        g = self.decay(self.f_b_proj(self.f_a_proj(x)))
        beta = torch.sigmoid(self.b_proj(x))
        o, cache.state = kda_step(*qkv, g, beta, cache.state)
        return self._gated_output(o, x)

    def _gated_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj(o_norm(o, gate(x))): the block's output from the KDA core's [B, T, H, V]."""
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (-1, self.head_dim))
        return self.o_proj(self.o_norm(o, gate).flatten(-2))
