"""CPU tests of the KDA custom op against an independent token-by-token recurrence."""

import pytest
import torch
import torch._dynamo

from torchtitan_glm.ops.kda import kda, kda_reference

H, K, V = 3, 16, 12


def recurrent_kda(q, k, v, g, beta):
    """Token loop in fp64 (one document per row): the definition the op must reproduce."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt(q.square().sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    b, t, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(t):
        state = state * g[:, i].exp().unsqueeze(-1)
        pred = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        state = state + k[:, i].unsqueeze(-1) * (beta[:, i].unsqueeze(-1) * (v[:, i] - pred)).unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
    return torch.stack(outs, 1)


def make_inputs(b, t, *, gate="logsigmoid", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, H, K, generator=gen)
    k = torch.randn(b, t, H, K, generator=gen)
    v = torch.randn(b, t, H, V, generator=gen)
    if gate == "logsigmoid":
        g = torch.nn.functional.logsigmoid(torch.randn(b, t, H, K, generator=gen))
    elif gate == "min":
        g = torch.full((b, t, H, K), -5.0)
    else:  # uniform in [-5, 0)
        g = -5.0 * torch.rand(b, t, H, K, generator=gen)
    beta = torch.rand(b, t, H, generator=gen)
    do = torch.randn(b, t, H, V, generator=gen)
    return [q, k, v, g, beta], do


def value_and_grads(fn, inputs, do):
    xs = [x.clone().requires_grad_(True) for x in inputs]
    o = fn(*xs)
    grads = torch.autograd.grad(o, xs, do.to(o.dtype))
    return [o.detach(), *grads]


def assert_rel_close(actual, expected, tol, names=("o", "dq", "dk", "dv", "dg", "dbeta")):
    for name, a, e in zip(names, actual, expected):
        assert torch.isfinite(a).all(), f"{name} not finite"
        err = (a.double() - e.double()).abs().max() / e.double().abs().max()
        assert err < tol, f"{name}: rel err {err:.2e} >= {tol}"


@pytest.mark.parametrize("gate", ["logsigmoid", "uniform", "min"])
def test_matches_recurrence(gate):
    inputs, do = make_inputs(2, 150, gate=gate)  # T = 2*64 + 22: padded last chunk
    got = value_and_grads(lambda *x: kda(*x, safe_gate=True), inputs, do)
    want = value_and_grads(recurrent_kda, inputs, do)
    assert_rel_close(got, want, 2e-5)


def test_reference_handles_strong_gates_in_backward():
    # Cumulative gate reaches -5 * 64 = -320 per chunk; a mask-after-exp chunk form overflows here.
    # (fp32 cumsums of that size carry ~3e-5 absolute error into G_t - G_s, hence the looser dg bound.)
    inputs, do = make_inputs(1, 128, gate="min", seed=1)
    got = value_and_grads(kda_reference, inputs, do)
    want = value_and_grads(recurrent_kda, inputs, do)
    assert_rel_close(got, want, 5e-5)


def _separately(inputs, seq_idx, do):
    """Run every (row, document) run through kda on its own; returns [o, *grads] like value_and_grads."""
    xs = [x.clone().requires_grad_(True) for x in inputs]
    rows = []
    for b in range(seq_idx.shape[0]):
        s = seq_idx[b]
        cut = [0, *(torch.nonzero(s[1:] != s[:-1]).flatten() + 1).tolist(), s.numel()]
        rows.append(torch.cat([kda(*(x[b:b + 1, i:j] for x in xs), safe_gate=False)
                               for i, j in zip(cut[:-1], cut[1:])], 1))
    o = torch.cat(rows, 0)
    return [o.detach(), *torch.autograd.grad(o, xs, do)]


def test_seq_idx_restarts_state_per_document():
    inputs, do = make_inputs(1, 150, gate="uniform", seed=2)
    seq_idx = torch.tensor([0] * 37 + [1] * 70 + [2] * 43, dtype=torch.int32)[None]
    got = value_and_grads(lambda *x: kda(*x, seq_idx, safe_gate=False), inputs, do)
    assert_rel_close(got, _separately(inputs, seq_idx, do), 1e-5)
    # and documents really are isolated: differs from treating the row as one sequence
    whole = kda(*inputs, safe_gate=False)
    assert (got[0][:, 37:] - whole[:, 37:]).abs().max() > 1e-3


def test_seq_idx_two_rows_restart_at_row_start_and_on_any_change():
    inputs, do = make_inputs(2, 100, seed=3)
    # Row 1 continues row 0's last id (must still restart at the row start); row 1 reuses id 0 later.
    seq_idx = torch.tensor([[0] * 60 + [7] * 40, [7] * 25 + [0] * 50 + [3] * 25], dtype=torch.int32)
    got = value_and_grads(lambda *x: kda(*x, seq_idx, safe_gate=False), inputs, do)
    assert_rel_close(got, _separately(inputs, seq_idx, do), 1e-5)


def test_bf16_inputs_give_bf16_output_and_grads():
    inputs, do = make_inputs(1, 70, seed=4)
    xs = [x.bfloat16().requires_grad_(True) for x in inputs]
    o = kda(*xs, safe_gate=True)
    o.backward(do.bfloat16())
    assert o.dtype == torch.bfloat16 and all(x.grad.dtype == torch.bfloat16 for x in xs)
    ref = recurrent_kda(*xs)
    assert ((o.double() - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_opcheck(with_seq_idx):
    inputs, do = make_inputs(2, 40, seed=5)
    seq_idx = torch.tensor([[0] * 15 + [1] * 25, [4] * 40], dtype=torch.int32) if with_seq_idx else None
    xs = [x.clone().requires_grad_(True) for x in inputs]  # also checks the autograd registration
    torch.library.opcheck(torch.ops.torchtitan_glm.kda_fwd.default, (*xs, seq_idx, True, False))
    torch.library.opcheck(torch.ops.torchtitan_glm.kda_bwd.default, (do, *inputs, seq_idx, [], True))


def test_compile_fullgraph_no_graph_breaks():
    inputs, do = make_inputs(2, 90, gate="uniform", seed=6)
    seq_idx = torch.tensor([[0] * 30 + [1] * 60, [2] * 90], dtype=torch.int32)

    def block(q, k, v, g, beta):
        o = kda(q * 1.5, k, v, g, beta, seq_idx, safe_gate=True)
        return o.tanh()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got = value_and_grads(compiled, inputs, do)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert_rel_close(got, value_and_grads(block, inputs, do), 1e-6)


@pytest.mark.parametrize("lengths", [[64], [1, 63, 65, 128, 3], [200, 1, 1, 130]])
def test_varlen_chunk_indices_enumerate_every_chunk(lengths):
    """The host-built chunk table FLA's varlen kernels take: one (sequence, chunk) row per started 64-token chunk."""
    from torchtitan_glm.ops.kda import _chunk_indices

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    want = [(n, c) for n, length in enumerate(lengths) for c in range(-(-length // 64))]
    assert _chunk_indices(cu, 64).tolist() == [list(x) for x in want]


def test_host_document_ids_reach_kda_past_fsdp_input_moves():
    """The trainer's host document ids reach the KDA op as a host tensor: FSDP2's root pre-forward moves every tensor
    in the inputs' tuples to the device (a blocking copy; `meta` stands in for CUDA here), not the HostDocIds
    wrapper; batch_layout keeps them for KDA while the layers' coordinates come from the device copy."""
    from torch.distributed.utils import _to_kwargs

    from torchtitan_glm.models.glm5.batch import batch_layout, train_batch

    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    tokens = torch.arange(8).unsqueeze(0)
    batch = train_batch(tokens, tokens, ids, host_doc_ids=ids)
    (moved,), _ = _to_kwargs((batch,), {}, torch.device("meta"), False)
    moved = moved[0]
    assert moved.tokens.device.type == "meta" and moved.doc_ids.device.type == "meta"
    assert moved.host_doc_ids.ids is ids
    layout = batch_layout(moved.doc_ids, (1, 8), torch.device("meta"), host_doc_ids=moved.host_doc_ids.ids)
    assert layout.kda_seq_idx is ids and layout.doc.pos.device.type == "meta"
    on_cpu = batch_layout(ids, (1, 8), torch.device("cpu"))
    assert on_cpu.host_doc_ids is None and on_cpu.kda_seq_idx is ids
    assert on_cpu.doc.pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    with pytest.raises(ValueError, match="host_doc_ids"):
        batch_layout(None, (1, 8), torch.device("cpu"), host_doc_ids=ids)
