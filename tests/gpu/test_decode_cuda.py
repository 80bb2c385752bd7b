"""CUDA decode path: FLA's fused_recurrent_kda step and chunk_kda prefill (with final states) against the torch
references, the Triton sparse MLA over a latent cache longer than the queries, and the debug model's decode against
its training forward on the GPU."""

from __future__ import annotations

import pytest
import torch

from torchtitan_glm.ops.kda_decode import kda_prefill, kda_prefill_reference, kda_step, kda_step_reference
from torchtitan_glm.ops.sparse_mla import sparse_mla, sparse_mla_reference

from .test_kda_fla import _fla_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fla_usable(), reason="needs CUDA and fla-core with triton")]

DEV = "cuda"
H, D = 4, 128  # the head shape tests/gpu/test_kda_fla.py autotunes


def _inputs(b, t, dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(b, t, H, D, device=DEV, generator=gen).to(dtype) for _ in range(3))
    g = -5.0 * torch.sigmoid(2.0 * torch.randn(b, t, H, D, device=DEV, generator=gen))  # GLM's bounded gate, FP32
    beta = torch.rand(b, t, H, device=DEV, generator=gen).to(dtype)
    return q, k, v, g, beta


def _ratio(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.float(), e.float()
    assert torch.isfinite(a).all()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 3])
def test_fla_recurrent_step_matches_reference(dtype, tol, t):
    """fused_recurrent_kda (forward only) from a random FP32 state == the torch scan on the same rounded values."""
    b = 3
    inputs = _inputs(b, t, dtype, seed=t)
    state = torch.randn(b, H, D, D, device=DEV, generator=torch.Generator(device=DEV).manual_seed(9)) * 0.1
    o, new = kda_step(*inputs, state)
    o_ref, new_ref = kda_step_reference(*(x.float() for x in inputs), state)
    assert o.dtype == dtype and new.dtype == torch.float32
    assert _ratio(o, o_ref) < tol and _ratio(new, new_ref) < tol


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left_padded"])
def test_fla_prefill_final_state_matches_reference(padded):
    """chunk_kda_fwd with output_final_state: outputs and the state after each row's last document (a left-padding
    document before it restarts the state) == the torch reference, then a step from that state agrees too."""
    b, t = 3, 150
    inputs = _inputs(b, t, torch.bfloat16, seed=4)
    seq_idx = None
    if padded:
        lengths = torch.tensor([150, 97, 5], device=DEV)
        seq_idx = (torch.arange(t, device=DEV) >= (t - lengths).unsqueeze(1)).to(torch.int32)
    o, state = kda_prefill(*inputs, seq_idx, True)
    o_ref, state_ref = kda_prefill_reference(*(x.float() for x in inputs), seq_idx)
    assert state.shape == (b, H, D, D) and state.dtype == torch.float32
    assert _ratio(o, o_ref) < 2e-2 and _ratio(state, state_ref) < 2e-2


def test_triton_sparse_mla_reads_a_longer_latent_cache():
    """Decode: one query per row against a [B, capacity, D] latent cache (keys > queries)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    b, cap, heads, dim, k = 4, 300, 16, 512, 67
    q = torch.randn(b, 1, heads, dim, device=DEV, generator=gen).to(torch.bfloat16)
    kv = torch.randn(b, cap, dim, device=DEV, generator=gen).to(torch.bfloat16)
    pos = torch.tensor([299, 150, 66, 10], device=DEV)
    r = torch.rand(b, cap, device=DEV, generator=gen).masked_fill(torch.arange(cap, device=DEV) > pos[:, None], -1)
    top = r.topk(k, dim=-1)
    indices = torch.where(top.values >= 0, top.indices, -1).int().unsqueeze(1)
    got = sparse_mla(q, kv, indices, scale=0.0625)
    want, _ = sparse_mla_reference(q.float(), kv.float(), indices, scale=0.0625)
    assert _ratio(got, want) < 1e-2


@torch.no_grad()
def test_debug_model_decode_matches_forward_on_cuda():
    """The debug model on the GPU (FLA prefill + recurrent steps, Triton sparse MLA): decode logits against the
    training forward, FP32 and BF16, with every expert and every pool selected.

    FLA's kernels compute FP32 through TF32 (about 1e-3 relative). A near-tied discrete choice (an expert of the
    top-k routing, a pool of the indexer's top-k) that flips under such noise changes that position and the ones
    that read its state at order one: on the H200 (2026-12-03) the FP32 comparison with top-2 routing and
    index_topk = 8 failed at max relative error 0.33; on CPU one flip in BF16 takes the log-prob Pearson from
    0.999999 to 0.990 (2026-12-07). So both comparisons select everything (the kernels' numerics alone); the
    discrete choices are compared exactly on CPU (tests/unit/test_decode.py) and statistically on a trained
    checkpoint by scripts/rollout_agreement.py. Even without choices, 1e-3 relative noise on the KDA outputs gives
    5.7e-3 on CPU (2026-12-07; this test's former fixed bound was 5e-3, and it failed on an H100 that day): so the
    FP32 bar is the CUDA training forward's own distance from the CPU reference, decode within 4x of it."""
    import copy

    from tests.decode_util import decoded_logits, max_rel_err, packed_logits, random_docs, randomize
    from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
    from torchtitan_glm.models.glm5.hf_io import _cast_for_load

    docs = random_docs([70, 33, 9, 48], 512, seed=2)
    prefill_lengths = [1, 4, 7, 30]
    base = get_flavor("debug").replace(num_nextn_predict_layers=0)
    no_choice = base.replace(index_topk=128, num_experts_per_tok=base.n_routed_experts)
    torch.manual_seed(0)
    reference = randomize(Glm5Model(no_choice), seed=1).eval()
    exact = packed_logits(reference, docs)  # CPU: the torch references in FP32
    model = copy.deepcopy(reference).to(DEV)
    cuda_docs = [d.to(DEV) for d in docs]
    on_host = lambda logits: [x.cpu() for x in logits]  # noqa: E731
    floor = max_rel_err(on_host(packed_logits(model, cuda_docs)), exact)
    err = max_rel_err(on_host(decoded_logits(model, cuda_docs, prefill_lengths)), exact)
    print(f"FP32 max relative error against the CPU reference: forward {floor:.2e}, decode {err:.2e}")
    assert err <= 4 * floor + 1e-5 and err < 2e-2, (err, floor)

    _cast_for_load(model, torch.bfloat16)  # FP32-kept modules stay FP32, as from_pretrained leaves them
    got = torch.cat([x.float().log_softmax(-1) for x in decoded_logits(model, cuda_docs, prefill_lengths)])
    want = torch.cat([x.float().log_softmax(-1) for x in packed_logits(model, cuda_docs)])
    pearson = float(torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1])
    print(f"BF16 decode against forward: log-prob Pearson {pearson:.6f}")
    assert pearson > 0.999, pearson
