"""activation_checkpoint.offload_inputs (issue 11, long context): under full AC the blocks' saved inputs go through
activation_checkpoint.HostOffload (copied on CPU here: copy_host_tensors) and come back for the recompute; loss and
gradients are bit-identical to full AC without it, and what moves is exactly each block's inputs."""

from __future__ import annotations

import pytest
import torch

from tests.compile.builders import BATCH, SEQLEN, build_model, debug_args, make_batch, train_forward, training_loss
from torchtitan_glm.activation_checkpoint import HostOffload, apply_activation_checkpointing, offload_host_bytes
from torchtitan_glm.compile import apply_compile
from torchtitan_glm.config import ActivationCheckpointConfig, ConfigError, JobConfig


def _step(offload: bool, *, compiled: bool = False):
    model = build_model(0)
    apply_activation_checkpointing(model, mode="full", offload_inputs=offload)
    packed: list[tuple[tuple[int, ...], torch.dtype]] = []
    if offload:
        assert isinstance(model.block_offload, HostOffload)
        model.block_offload = HostOffload(copy_host_tensors=True)  # CPU: copy what a GPU run moves to the host
        orig = model.block_offload._pack

        def spy(t):
            out = orig(t)
            if isinstance(out, tuple):
                packed.append((tuple(t.shape), t.dtype))
                assert out[1].data_ptr() != t.data_ptr()  # a copy, not the tensor itself
            return out

        model.block_offload._pack = spy
    if compiled:  # as the trainer compiles (full AC through activation_checkpoint.for_compile)
        apply_compile(model, backend="aot_eager", components=["model"])
    batch = make_batch(0, model.args.vocab_size)
    n = int((batch.labels != -100).sum())
    loss = training_loss(train_forward(model, batch, token_scale=1.0 / n, mtp_scale=0.1 / n))
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): p.grad
             for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, packed, model.block_offload


@pytest.fixture(scope="module")
def plain_full():
    return _step(False)


def test_offloaded_inputs_give_identical_loss_and_grads(plain_full):
    ref_loss, ref_grads, _, _ = plain_full
    loss, grads, packed, offload = _step(True)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key, g in grads.items():
        assert torch.equal(g, ref_grads[key]), key
    args = debug_args()
    streams = (BATCH, SEQLEN, args.hc_mult, args.hidden_size)
    # every decoder layer's input streams and the MTP's two [B, T, D] inputs, nothing else (the debug model has no
    # shared DSA layer, whose token indices would move too; no parameter)
    assert [s for s, _ in packed].count(streams) == args.num_hidden_layers, packed
    assert [s for s, _ in packed].count((BATCH, SEQLEN, args.hidden_size)) == 2, packed
    assert len(packed) == args.num_hidden_layers + 2, packed
    assert offload.offloaded_bytes == sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                                          for s, d in packed)
    # what the trainer checks against the host's memory before it starts (FP32 here)
    assert offload.offloaded_bytes == offload_host_bytes(args, tokens=BATCH * SEQLEN, act_bytes=4, mtp=True)


@pytest.mark.long
def test_compiled_blocks_offload_the_same_inputs(plain_full):
    """Blocks compiled with fullgraph=True (AOTAutograd saves the checkpoint's inputs): the hooks still apply."""
    ref_loss, ref_grads, _, _ = plain_full
    loss, grads, packed, _ = _step(True, compiled=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
    args = debug_args()
    # the compiled graphs save their int64 document inputs and the router's bias buffer too (no parameter)
    assert [s for s, _ in packed].count((BATCH, SEQLEN, args.hc_mult, args.hidden_size)) == args.num_hidden_layers
    others = [(s, d) for s, d in packed if not (s[:2] == (BATCH, SEQLEN) or d == torch.float32 and len(s) == 1)]
    assert not others, others


def test_offload_needs_full_ac():
    with pytest.raises(ConfigError, match="activation_checkpoint.offload_inputs"):
        JobConfig(activation_checkpoint=ActivationCheckpointConfig(mode="selective", offload_inputs=True)).validate()
    with pytest.raises(ValueError, match="offload_inputs"):
        apply_activation_checkpointing(build_model(0), mode="none", offload_inputs=True)


def test_planner_moves_the_inputs_to_the_host_and_times_the_copies_back():
    """The plan of the proxy at 128K, full AC: with offload_inputs the checkpointed inputs leave the device's
    activations, the peak drops by at most their bytes, and the step gains their copies back at the host link's rate."""
    from torchtitan_glm.planner import Request, plan
    from torchtitan_glm.planner.hardware import GIB, H200
    from torchtitan_glm.planner.report import plan_text

    argv = ("--config", "train_configs/glm5_3_flash_proxy.toml", "--training.seq_len=131072",
            "--activation_checkpoint.mode=full", "--activation_checkpoint.moe_chunk_tokens=16384")
    kept = plan(Request(argv, 1, H200, "bench_train"))
    moved = plan(Request((*argv, "--activation_checkpoint.offload_inputs=true"), 1, H200, "bench_train"))
    inputs = kept.memory.activation_terms["inputs"]
    assert inputs > 30 * GIB and "inputs" not in moved.memory.activation_terms
    assert kept.memory.peak - inputs <= moved.memory.peak < kept.memory.peak
    copies = moved.time.exposed_comm_s["offloaded block inputs, host to device"]
    assert copies * H200.host_link == pytest.approx(inputs, rel=0.01)
    assert moved.time.step_s == pytest.approx(kept.time.step_s + copies, rel=1e-6)
    assert moved.memory.host_pinned == pytest.approx(inputs, rel=1e-9) and kept.memory.host_pinned == 0
    assert f"host memory per rank: {inputs / GIB:.1f} GiB pinned" in plan_text(moved)


def _proxy_cfg(*extra: str):
    from torchtitan_glm.config import load_config

    return load_config(["--config", "train_configs/glm5_3_flash_proxy.toml", "--training.seq_len=131072",
                        "--activation_checkpoint.mode=full", "--activation_checkpoint.offload_inputs=true", *extra])


def test_trainer_stops_before_pinning_more_host_memory_than_the_host_has():
    """train.py's check (before any process group): the proxy at 128K pins 34 GiB per rank (measured 34.0 on the
    H200); 8 ranks of that on a host with 128 GiB available is a ConfigError naming the key, not an OOM kill."""
    from torchtitan_glm.train import build_model_args, check_offload_host_memory, offload_pinned_bytes

    cfg = _proxy_cfg()
    args = build_model_args(cfg)
    need = offload_pinned_bytes(cfg, args, cp=1)
    assert need / 2**30 == pytest.approx(34.0, rel=1e-3)
    assert offload_pinned_bytes(cfg, args, cp=2) == need // 2
    check_offload_host_memory(cfg, args, cp=1, local_ranks=1, available=128 * 2**30)
    check_offload_host_memory(cfg, args, cp=1, local_ranks=8, available=None)  # not Linux: nothing to check
    with pytest.raises(ConfigError, match=r"activation_checkpoint.offload_inputs.*34.0 GiB.*8 rank\(s\).*272.0 GiB"):
        check_offload_host_memory(cfg, args, cp=1, local_ranks=8, available=128 * 2**30)
    off = _proxy_cfg("--activation_checkpoint.offload_inputs=false")
    assert offload_pinned_bytes(off, args, cp=1) == 0
    check_offload_host_memory(off, args, cp=1, local_ranks=8, available=1)


def test_planner_and_trainer_count_the_same_host_bytes():
    from torchtitan_glm.planner import Request, plan
    from torchtitan_glm.planner.hardware import H200
    from torchtitan_glm.train import build_model_args, offload_pinned_bytes

    argv = ("--config", "train_configs/glm5_3_flash_proxy.toml", "--training.seq_len=131072",
            "--activation_checkpoint.mode=full", "--activation_checkpoint.offload_inputs=true")
    planned = plan(Request(argv, 1, H200, "train")).memory.host_pinned
    need = offload_pinned_bytes(_proxy_cfg(), build_model_args(_proxy_cfg()), cp=1)
    ints = 131072 * (6 * 16 + 2 * 24 + 24)  # the planner also counts the int64 document inputs
    assert planned == pytest.approx(need + ints, rel=1e-9)
