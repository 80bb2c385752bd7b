"""One DSA layer's attention, forward + backward, on one GPU: the sparse op (absorbed MLA over K gathered latent
tokens, ops/sparse_mla.py) against dense SDPA under the [T, T] selection mask (the path before issue 11; in one call
and in causal query chunks, ops/masked_attention.py) and dense causal SDPA (flash), at GLM-5.3-Flash's shapes
(64 heads, qk = v = 256, latent 512, K = 2051).

    python scripts/bench_dsa.py                       # T = 32768
    python scripts/bench_dsa.py --seq-len 8192,32768 --layer

Every variant gets the same random causal selection of K tokens per query (fewer for queries t < K). --layer also
times the whole SparseMLA block of the proxy (projections, tiled indexer top-k, sparse attention, sparse KL) in
BF16 against the same block in the dense warm-up form (masked SDPA, dense KL). Prints one JSON line per variant
and a markdown table; CUDA events, median of --steps after --warmup (the first sparse call autotunes its Triton
kernels: tens of seconds).

The attention rows also give the FLOP rate each variant reaches, by the FLOPs it must do: per (query, key) pair and
head, the sparse op's seven products over the 512-wide latent (forward: scores and values; backward: the scores
again, dP, dQ and dKV's two) are 14 x 512; the dense variants' forward and backward are 8 x qk + 6 x v, over T^2
pairs under the mask (the kernel computes every pair) and T (T + 1) / 2 causal ones. The footer says at what rate
the sparse op would reach 3x causal SDPA's time (issue 11's target): the rate the kernel must reach, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from cuda_timing import at_least, int_list, median_ms

from torchtitan_glm.ops.masked_attention import masked_keys_per_query

H, QK, V, R = 64, 256, 256, 512


def attention_flops(seqlen: int, k: int) -> dict[str, float]:
    """FLOPs of one forward + backward of each attention variant (see the module docstring)."""
    sparse_pairs = sum(min(t + 1, k) for t in range(seqlen))
    dense_per_pair = (8 * QK + 6 * V) * H
    return {"sparse op (absorbed, K gathered)": 14 * R * H * sparse_pairs,
            "dense SDPA, [T, T] mask": dense_per_pair * seqlen * seqlen,
            **{f"dense SDPA, [T, T] mask, query chunks of {c}":
               dense_per_pair * seqlen * masked_keys_per_query(seqlen, c)[0] for c in (1024, 512)},
            f"dense SDPA, first {k} rows causal, then [T, T] mask in query chunks of 1024":
               dense_per_pair * seqlen * sum(masked_keys_per_query(seqlen, 1024, k)),
            "dense SDPA, causal": dense_per_pair * seqlen * (seqlen + 1) / 2}


def causal_selection(seqlen: int, k: int, device: str) -> torch.Tensor:
    """[1, T, K] int32: k distinct random tokens <= t per query (all of them when t < k), -1 padding."""
    out = torch.empty(1, seqlen, k, dtype=torch.int32, device=device)
    for s in range(0, seqlen, 1024):
        t = torch.arange(s, min(s + 1024, seqlen), device=device)
        r = torch.rand(t.numel(), max(seqlen, k), device=device).masked_fill(
            torch.arange(max(seqlen, k), device=device)[None, :] > t[:, None], -1.0)
        top = r.topk(k, dim=-1)
        out[0, s:s + t.numel()] = torch.where(top.values >= 0, top.indices, -1).int()
    return out


def attention_variants(seqlen: int, k: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    from torchtitan_glm.ops.masked_attention import masked_attention
    from torchtitan_glm.ops.sparse_mla import sparse_mla

    idx = causal_selection(seqlen, k, device)
    kw = dict(device=device, dtype=dtype, requires_grad=True)
    q_lat, latent = torch.randn(1, seqlen, H, R, **kw), torch.randn(1, seqlen, R, **kw)
    q, kk, v = (torch.randn(1, H, seqlen, d, **kw) for d in (QK, QK, V))
    mask = torch.zeros(1, seqlen, seqlen + 1, dtype=torch.bool, device=device)
    mask.scatter_(-1, torch.where(idx >= 0, idx.long(), seqlen), True)
    mask = mask[:, None, :, :seqlen]
    scale = QK**-0.5

    def sparse():
        out = sparse_mla(q_lat, latent, idx, scale=scale)
        torch.autograd.grad(out, (q_lat, latent), torch.ones_like(out))

    def dense_masked():
        out = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, scale=scale)
        torch.autograd.grad(out, (q, kk, v), torch.ones_like(out))

    def chunked(rows):  # the same mask in causal query chunks (model.dsa_mask_query_chunk)
        def run():
            out = masked_attention(q, kk, v, mask[:, 0], scale=scale, causal_chunk=rows)
            torch.autograd.grad(out, (q, kk, v), torch.ones_like(out))
        return run

    def causal_rows_then_chunks():  # one document: the first k rows select their whole past (causal_rows)
        out = masked_attention(q, kk, v, mask[:, 0], scale=scale, causal_chunk=1024, causal_rows=k)
        torch.autograd.grad(out, (q, kk, v), torch.ones_like(out))

    def dense_causal():
        out = F.scaled_dot_product_attention(q, kk, v, is_causal=True, scale=scale)
        torch.autograd.grad(out, (q, kk, v), torch.ones_like(out))

    return {"sparse op (absorbed, K gathered)": sparse, "dense SDPA, [T, T] mask": dense_masked,
            "dense SDPA, [T, T] mask, query chunks of 1024": chunked(1024),
            "dense SDPA, [T, T] mask, query chunks of 512": chunked(512),
            f"dense SDPA, first {k} rows causal, then [T, T] mask in query chunks of 1024": causal_rows_then_chunks,
            "dense SDPA, causal": dense_causal}


def layer_variants(seqlen: int, device: str = "cuda", flavor: str = "glm5_3_flash_proxy",
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    from torchtitan_glm.models.glm5 import get_flavor
    from torchtitan_glm.models.glm5.batch import BatchLayout
    from torchtitan_glm.models.glm5.dsa import DocLayout, SparseMLA
    from torchtitan_glm.models.glm5.seqinfo import doc_positions

    args = get_flavor(flavor).replace(indexer_tile_elements=1 << 28, dsa_dense_max_len=0)
    doc = DocLayout(*doc_positions(None, 1, seqlen, torch.device(device)))
    x = torch.randn(1, seqlen, args.hidden_size, device=device, dtype=dtype, requires_grad=True)
    out = {}
    masked = (f"SparseMLA block, selection as a [T, T] mask (dsa_dense_max_len), query chunks of "
              f"{args.dsa_mask_query_chunk}")
    # one document per row (no doc_ids): the masked forms run their plain causal rows without the mask
    # (model.dsa_mask_causal_rows): the selection's first rows, the whole dense stage
    for name, stage, kl, dense_max, causal_rows in (
            ("SparseMLA block, sparse + sparse KL", "sparse", "sparse", 0, True),
            ("SparseMLA block, sparse, no KL", "sparse", None, 0, True),
            (f"{masked}, no KL", "sparse", None, seqlen, False),
            (f"{masked} after the first rows causal, no KL", "sparse", None, seqlen, True),
            ("SparseMLA block, dense warm-up (causal mask) + dense KL", "dense", "dense", 0, False),
            ("SparseMLA block, dense warm-up (causal kernel, no mask) + dense KL", "dense", "dense", 0, True)):
        with torch.device(device):
            block = SparseMLA(args.replace(dsa_attention=stage, dsa_dense_max_len=dense_max,
                                           dsa_mask_causal_rows=causal_rows))
            block.init_weights()
        block.to(dtype)

        def step(block=block, kl=kl):
            o, _, stats = block(x, BatchLayout(doc, None, None, kl))
            loss = o.float().square().mean() + (stats.kl_sum / stats.rows if stats is not None else 0)
            loss.backward()
            block.zero_grad(set_to_none=True)
            x.grad = None

        out[name] = step
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int_list(), default=(32768,), help="comma-separated T values")
    p.add_argument("--k", type=at_least(1), default=2051, help="tokens per query (index_topk + kpool - 1)")
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--warmup", type=at_least(0), default=3)
    p.add_argument("--layer", action="store_true", help="also time the whole proxy SparseMLA block")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_dsa.py: needs a CUDA GPU (the sparse op's fast path is a Triton kernel); none is visible.",
              file=sys.stderr)
        sys.exit(2)
    rows = []
    for seqlen in a.seq_len:
        flops = attention_flops(seqlen, a.k)
        variants = attention_variants(seqlen, a.k)
        if a.layer:
            variants.update(layer_variants(seqlen))
        for name, fn in variants.items():
            torch.cuda.reset_peak_memory_stats()
            try:
                ms = median_ms(fn, steps=a.steps, warmup=a.warmup)
            except torch.OutOfMemoryError:
                ms = float("nan")
            row = dict(seq_len=seqlen, variant=name, family="block" if name.startswith("SparseMLA") else "attention",
                       fwd_bwd_ms=round(ms, 2),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            if name in flops:
                row["tflops"] = round(flops[name] / (ms * 1e-3) / 1e12, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del variants
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, K = {a.k}\n")
    print("| T | variant | fwd+bwd ms | TFLOP/s | peak GiB | time / sparse time |\n|---|---|---|---|---|---|")
    for r in rows:  # against the first (sparse) variant of the same family and T
        base = next(x for x in rows if x["seq_len"] == r["seq_len"] and x["family"] == r["family"])
        print(f"| {r['seq_len']:,} | {r['variant']} | {r['fwd_bwd_ms']} | {r.get('tflops', '')} | {r['peak_gib']} | "
              f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x |")
    for seqlen in sorted({r["seq_len"] for r in rows}):
        causal = next(r for r in rows if r["seq_len"] == seqlen and r["variant"] == "dense SDPA, causal")
        need = attention_flops(seqlen, a.k)["sparse op (absorbed, K gathered)"] / (causal["fwd_bwd_ms"] / 3 * 1e-3)
        print(f"\nT = {seqlen:,}: the sparse op reaches 3x causal SDPA's time ({causal['fwd_bwd_ms'] / 3:.1f} ms) at "
              f"{need / 1e12:.0f} TFLOP/s, {need / 1e12 / causal.get('tflops', float('nan')):.0%} of causal SDPA's "
              "rate")


if __name__ == "__main__":
    main()
