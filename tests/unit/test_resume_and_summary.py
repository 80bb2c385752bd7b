"""components/resume.py (what an exact resume needs, what a changed LR schedule does) and components/logs.py (the
start-up summary), against the objects they describe."""

from __future__ import annotations

import re

import pytest
import torch

from torchtitan_glm.components.logs import memory_per_rank, startup_summary
from torchtitan_glm.components.lr_scheduler import build_lr_scheduler
from torchtitan_glm.components.resume import (optimizer_note, precision_note, resume_mismatches, run_info,
                                              schedule_note)
from torchtitan_glm.config import load_config
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor


def _info(*argv: str) -> dict:
    from torchtitan_glm.train import build_model_args

    cfg = load_config(["--config", "train_configs/debug_model.toml", *argv])
    return run_info(cfg=cfg, args=build_model_args(cfg), tokenizer_vocab_size=259)


def test_resume_mismatches_name_the_key_and_both_values():
    saved = _info()
    assert resume_mismatches(saved, _info("--training.steps", "99", "--optimizer.lr", "1e-3")) == []
    assert resume_mismatches(saved, _info("--training.seq_len", "256")) == ["training.seq_len was 128, is 256"]
    changed = resume_mismatches(saved, _info("--model.flavor", "glm5_3_flash_proxy"))
    assert changed[0] == "model.flavor was 'debug', is 'glm5_3_flash_proxy'"
    assert "model.hidden_size was 64, is 4096" in changed
    assert resume_mismatches(saved, _info("--model.vocab_size", "1024")) == ["model.vocab_size was 512, is 1024"]
    assert resume_mismatches(saved, _info("--optimizer.name", "AdamW8bit")) == [
        "optimizer.name was 'AdamW', is 'AdamW8bit'"]
    assert resume_mismatches(_info("--loss.indexer_stage", "dense_warmup"), saved) == [
        "loss.indexer_stage was 'dense_warmup', is 'sparse'"]


def test_schedule_note_says_what_the_resumed_scheduler_does():
    """The note's numbers (3 significant digits) are the LR the real scheduler gives after a resume (its saved state
    loaded into a scheduler built for the new length, with a lower optimizer.lr: this run's peak applies)."""
    saved, longer = _info("--training.steps", "10"), _info("--training.steps", "20", "--optimizer.lr", "1e-3")
    note = schedule_note(saved, longer, 10)
    m = re.fullmatch(r"the LR schedule changed since the checkpoint \(optimizer\.lr 0\.003 -> 0\.001, training\.steps "
                     r"10 -> 20\): step 11 runs at lr (\S+) where the saved schedule gives (\S+), then follows the "
                     r"new schedule to lr (\S+) at step 20", note)
    assert m, note

    def scheduler(steps: int, lr: float):
        cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.steps", str(steps)])
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        return opt, build_lr_scheduler(optimizer=opt, cfg=cfg.lr_scheduler, total_steps=steps)

    opt_a, sched_a = scheduler(10, 3e-3)
    for _ in range(10):
        opt_a.step()
        sched_a.step()
    opt_b, sched_b = scheduler(20, 1e-3)
    sched_b.load_state_dict(sched_a.state_dict())
    assert float(m[1]) == pytest.approx(opt_b.param_groups[0]["lr"], rel=5e-3)
    assert float(m[2]) == pytest.approx(opt_a.param_groups[0]["lr"], rel=5e-3) == pytest.approx(3e-4, rel=5e-3)
    for _ in range(9):
        opt_b.step()
        sched_b.step()
    assert float(m[3]) == pytest.approx(opt_b.param_groups[0]["lr"], rel=5e-3)
    assert schedule_note(saved, _info("--training.steps", "10"), 10) is None


def test_schedule_note_names_the_first_step_whose_lr_changes():
    """Under WSD a longer run keeps the peak LR until the old decay would have started: the note names that step;
    a warmup change after the warmup changes no LR left, so there is no note."""
    wsd = ("--lr_scheduler.decay_type", "wsd", "--lr_scheduler.decay_ratio", "0.1")
    saved = _info("--training.steps", "100", *wsd)
    note = schedule_note(saved, _info("--training.steps", "200", *wsd), 20)
    assert note is not None and "the same LR to step 90, then step 91 runs at lr 0.003 where the saved schedule " \
        "gives 0.00273" in note, note  # 3e-3 * (0.1 + 0.9 * (1 - 1/10)): the linear WSD decay
    assert schedule_note(saved, _info("--training.steps", "100", "--lr_scheduler.warmup_steps", "8", *wsd), 20) is None
    assert schedule_note(saved, _info("--training.steps", "100", "--lr_scheduler.warmup_steps", "8", *wsd), 3)


def test_precision_note_names_the_change_both_ways():
    bf16, fp8 = _info(), _info("--float8.enable", "true")
    assert resume_mismatches(bf16, fp8) == []  # names and values carry over: an allowed change
    note = precision_note(bf16, fp8)
    assert note is not None and "float8.enable False -> True" in note
    param = bf16["config"]["training"]["mixed_precision_param"]
    assert f"ran {param} (float8 off), from here on FP8 tensorwise, FP8 grouped experts, kept {param}: indexer, " \
           "mla, kda" in note
    back = precision_note(fp8, bf16)
    assert back is not None and f"from here on {param} (float8 off)" in back
    assert "float8.recipe 'tensorwise' -> 'rowwise'" in precision_note(fp8, _info("--float8.enable", "true",
                                                                                 "--float8.recipe", "rowwise"))
    assert precision_note(fp8, _info("--float8.enable", "true")) is None
    # a float8 key changed while float8 stays off computes nothing differently
    assert precision_note(bf16, _info("--float8.recipe", "rowwise")) is None


def test_optimizer_note_names_the_changed_settings():
    saved = _info()
    assert optimizer_note(saved, _info(), 10) is None
    assert optimizer_note(saved, _info("--optimizer.lr", "1e-3"), 10) is None  # the LR has its own note
    note = optimizer_note(saved, _info("--optimizer.weight_decay", "0.5", "--optimizer.beta1", "0.8"), 10)
    assert note == ("the optimizer settings changed since the checkpoint (optimizer.beta1 0.9 -> 0.8, "
                    "optimizer.weight_decay 0.1 -> 0.5): its moments carry over and the new settings apply from "
                    "step 11")


def test_a_resume_applies_this_runs_optimizer_settings(tmp_path, world_of_one, caplog):
    """The checkpoint keeps the moments and the schedule's position; the peak lr, betas, eps, weight decay and the
    implementation are this run's (before, the checkpoint's param groups replaced them without a word)."""
    import torch.distributed as dist

    from torchtitan_glm.train import Trainer

    argv = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "32", "--training.local_batch_size",
            "1", "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps",
            "1", f"--job.dump_folder={tmp_path}"]
    Trainer(load_config([*argv, "--training.steps", "2"])).train()
    dist.destroy_process_group()
    changed = ["--optimizer.weight_decay", "0.5", "--optimizer.beta1", "0.5", "--optimizer.eps", "1e-4",
               "--optimizer.implementation", "for-loop", "--optimizer.lr", "1e-4",
               f"--checkpoint.initial_load_path={tmp_path / 'checkpoint' / 'step-2'}"]  # ignored by a resume: said
    with caplog.at_level("WARNING", logger="torchtitan_glm.train"):
        trainer = Trainer(load_config([*argv, "--training.steps", "3", *changed]))
        trainer.train()
    groups = trainer.optimizer.param_groups
    # the lowered peak lr applies from the resume on (step 3 of 3 ran at 1e-4 x the schedule's factor at step 2)
    factor = trainer.lr_scheduler.lr_lambdas[0](2)
    assert 0 < factor <= 1 and all(g["lr"] == pytest.approx(1e-4 * factor) for g in groups), [g["lr"] for g in groups]
    assert {g["weight_decay"] for g in groups} == {0.5, 0.0}
    assert all(g["betas"] == (0.5, 0.95) and g["eps"] == 1e-4 and not g["foreach"] and not g["fused"]
               for g in groups)
    assert [r.getMessage() for r in caplog.records if "optimizer settings changed" in r.getMessage()] == [
        "the optimizer settings changed since the checkpoint (optimizer.beta1 0.9 -> 0.5, optimizer.eps 1e-08 -> "
        "0.0001, optimizer.weight_decay 0.1 -> 0.5, optimizer.implementation 'foreach' -> 'for-loop'): its moments "
        "carry over and the new settings apply from step 3"]  # the implementations as they ran ('auto' on CPU)
    assert any(r.getMessage().startswith("checkpoint.initial_load_path ") and "is not read: this run resumes from "
               "its own checkpoint" in r.getMessage() for r in caplog.records)


def test_an_implementation_spelled_otherwise_is_no_change():
    """optimizer.implementation "auto" and what it resolves to are the same step: no resume note (run.json records
    the implementation that ran); a checkpoint without that record compares the keys as written."""
    from torchtitan_glm.components.resume import optimizer_changes

    def info(impl, ran):
        return {"config": {"optimizer": {"name": "AdamW8bit", "lr": 1e-3, "implementation": impl}},
                **({"optimizer_step": ran} if ran else {})}

    assert optimizer_changes(info("fused", "fused"), info("auto", "fused")) == []
    assert optimizer_changes(info("auto", "compiled"), info("auto", "fused")) == [
        "optimizer.implementation 'compiled' -> 'fused'"]
    assert optimizer_changes(info("fused", None), info("auto", "fused")) == [
        "optimizer.implementation 'fused' -> 'auto'"]


def test_startup_summary_counts_this_ranks_state():
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.local_batch_size", "3"])
    model = Glm5Model(get_flavor("debug"))
    for p in model.mtp.parameters():
        p.requires_grad_(False)
    total = sum(p.numel() * 4 for p in model.parameters())
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert memory_per_rank(model) == {"params": total, "grads": trainable, "optimizer": 2 * trainable}
    text = startup_summary(cfg=cfg, args=model.args, model=model, world=2, dp_size=2, device=torch.device("cpu"),
                           resume="fresh start")
    rows = dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", text, flags=re.M))
    assert set(rows) == {"model", "parameters", "layout", "precision", "compute", "memory/rank", "loss buffers",
                         "tokens/step", "steps", "dump folder", "tensorboard", "checkpoints", "resume"}
    assert rows["compute"] == "eager (compile.enable false); activation checkpointing " + cfg.activation_checkpoint.mode
    assert rows["tokens/step"].startswith("768 ")  # 128 x 3 x 2
    assert "(AdamW, foreach step; sharded state)" in rows["memory/rank"]
    # 384 rows x 2 (trunk + MTP) = 768 <= loss.ce_chunk_size 1024: one chunk, no FP32 [vocab, D] buffer
    assert rows["loss buffers"] == ("3.00 MiB logits chunk, 128.00 KiB LM-head weight gradient (one chunk: in the "
                                    "weight's dtype)")  # 768 x 512 x (4 + 4); 512 x 64 x 4
    assert rows["precision"] == "fp32 params, fp32 reduce"
    assert rows["tensorboard"] == "./outputs/debug/tb" and rows["resume"] == "fresh start"
    assert rows["model"].startswith("glm5 (flavor 'debug'): 4 layers (3 KDA + 1 DSA")
    # the state alone exceeds a (pretend) device: a "fits" row says so; a device it fits on gets no row
    state = sum(memory_per_rank(model, optimizer=cfg.optimizer).values())
    for device_bytes, warned in ((state - 1, True), (state, False)):
        text = startup_summary(cfg=cfg, args=model.args, model=model, world=2, dp_size=2, device=torch.device("cpu"),
                               resume="fresh start", device_bytes=device_bytes)
        fits = dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", text, flags=re.M)).get("fits")
        assert (fits is not None and fits.startswith("NO: params + grads + optimizer")) == warned, fits

    low_bit = load_config(["--config", "train_configs/debug_model.toml", "--optimizer.name", "AdamW8bit",
                           "--loss.ce_chunk_size", "500", "--training.mixed_precision_param", "bfloat16"])
    text = startup_summary(cfg=low_bit, args=model.args, model=model, world=2, dp_size=2, device=torch.device("cpu"),
                           resume="fresh start")
    rows = dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", text, flags=re.M))
    assert "(AdamW8bit, fused step; sharded state)" in rows["memory/rank"]
    assert rows["loss buffers"] == ("1.46 MiB logits chunk, 128.00 KiB LM-head weight gradient (FP32: 1,024 rows > "
                                    "loss.ce_chunk_size 500)")  # 500 x 512 x (4 + 2); 512 x 64 x 4


def test_layout_note_says_what_changed_and_where_the_data_continues():
    from torchtitan_glm.components.resume import layout_note

    cfg = load_config(["--config", "train_configs/debug_model.toml"])

    def info(layout, rows):
        return run_info(cfg=cfg, args=cfg.model.model_args(), tokenizer_vocab_size=259, layout=layout,
                        global_batch_rows=rows)

    dp2, tp2 = ("dp_replicate=1 dp_shard=2 cp=1 tp=1 ep=1 (world 2)",
                "dp_replicate=1 dp_shard=1 cp=1 tp=2 ep=1 (world 2)")
    assert layout_note(info(dp2, 8), info(dp2, 8), next_row=80) is None
    assert layout_note(info(dp2, 8), info(tp2, 8), next_row=80) == (
        f"the parallel layout changed since the checkpoint ({dp2} -> {tp2}): its model and optimizer state are "
        "resharded onto this one and the data continues at global row 80")
    note = layout_note(info(dp2, 8), info(tp2, 4), next_row=80)
    assert "global batch changed from 8 to 4 rows" in note and "training.global_batch_size = 8" in note
    assert layout_note({"config": {}}, info(tp2, 4), next_row=80) is None  # a checkpoint from before: no facts
    plain = load_config(["--config", "train_configs/debug_model.toml", "--data.document_masking", "false"])
    unmasked = run_info(cfg=plain, args=plain.model.model_args(), tokenizer_vocab_size=259, layout=dp2,
                        global_batch_rows=8)
    assert layout_note(info(dp2, 8), unmasked, next_row=80) == (
        "data.document_masking changed from true to false: the same rows continue at global row 80, from here on "
        "each as one causal sequence, every label counted")
    assert "restarting at each document" in layout_note(unmasked, info(dp2, 8), next_row=80)


def test_startup_summary_shows_the_pinned_host_memory_of_offload_inputs():
    cfg = load_config(["--config", "train_configs/debug_model.toml"])
    model = Glm5Model(get_flavor("debug"))
    for pinned, row in ((0, None), (3 * 2**30, "3.00 GiB pinned host memory per rank")):
        text = startup_summary(cfg=cfg, args=model.args, model=model, world=1, dp_size=1, device=torch.device("cpu"),
                               resume="fresh start", host_pinned=pinned)
        got = dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", text, flags=re.M)).get("host offload")
        assert (got is None) if row is None else got.startswith(row), got


def test_planned_rows_are_the_planners_and_never_stop_the_run():
    from torchtitan_glm.planner import Request, plan
    from torchtitan_glm.planner.hardware import GIB, H200
    from torchtitan_glm.train import planned_rows

    argv = ["--config", "train_configs/glm5_3_flash_proxy.toml"]
    want = plan(Request(tuple(argv), 1, H200, "train"))
    row, speed = planned_rows(argv, gpus=1, device_bytes=int(H200.memory_bytes), device_name="NVIDIA H200")
    m = want.memory
    assert row.startswith(f"{m.peak / GIB:.1f} GiB allocated at {m.peak_at}, reserve {m.reserved / GIB:.1f}")
    parts = " | ".join(f"{k} {v / GIB:.1f}" for k, v in m.breakdown.items() if v)
    assert f"of the device's 139.8 (GiB: {parts}; scripts/plan.py)" in row and "optimizer 15.0" in parts
    assert speed.startswith(f"{want.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {want.time.step_s:.3f} s")
    # the speed only where the planner's kernel rates were measured; nothing without a GPU (CPU) or arguments
    assert planned_rows(argv, gpus=1, device_bytes=int(H200.memory_bytes), device_name="NVIDIA A100")[1] is None
    # without a GPU: the activations the planner counts (its inventories are the CPU captures'), no speed
    cpu_row, cpu_speed = planned_rows(argv, gpus=1, device_bytes=None)
    from torchtitan_glm.components.logs import format_bytes

    assert cpu_speed is None and cpu_row == (
        f"activations {format_bytes(m.breakdown['activations'])} kept for backward at the allocated peak of "
        f"{format_bytes(m.peak)} ({m.peak_at}; scripts/plan.py)")
    assert planned_rows(None, gpus=1, device_bytes=int(H200.memory_bytes)) == (None, None)
    bad, no_speed = planned_rows([*argv, "--optimizer.cpu_offload", "true", "--optimizer.name", "AdamW"], gpus=1,
                                 device_bytes=int(H200.memory_bytes), device_name="NVIDIA H200")
    assert bad.startswith("not planned (") and "cpu_offload" in bad and no_speed is None
    cfg = load_config(argv)
    model = Glm5Model(get_flavor("debug"))
    text = startup_summary(cfg=cfg, args=model.args, model=model, world=1, dp_size=1, device=torch.device("cpu"),
                           resume="fresh start", planned=row, planned_speed=speed)
    rows = dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", text, flags=re.M))
    assert rows["planned peak"] == row and rows["planned speed"] == speed


def test_compute_line_names_compile_and_the_ac_choices():
    from torchtitan_glm.components.logs import compute_line

    cfg = load_config(["--compile.enable", "true", "--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.recompute_modules", "kda,mhc",
                       "--activation_checkpoint.moe_chunk_tokens", "8192"])
    assert compute_line(cfg) == ("torch.compile inductor (model, loss); activation checkpointing selective, "
                                 "recompute_modules kda, mhc, routed experts in checkpointed chunks of 8,192 tokens")


def test_a_precision_control_resumes_with_a_note_and_a_parameter_change_does_not():
    """The model's precision controls add no parameter: a resume across them carries everything over and says so.
    hc_head (a learned head has parameters) and kpool_ape_trainable (another set of trained parameters) still
    need the same values."""
    saved = _info()
    for knob in ("mhc_fp32_mixing", "kpool_fp32_accumulate", "indexer_weights_fp32", "indexer_k_norm_fp32",
                 "indexer_fp8_emulation"):
        now = _info(f"--model.{knob}", "true")
        assert resume_mismatches(saved, now) == [], knob
        assert precision_note(saved, now) == (f"the compute precision changed since the checkpoint (model.{knob} "
                                              "False -> True): the weights and optimizer state carry over unchanged")
    assert resume_mismatches(saved, _info("--model.hc_head", "learned")) == ["model.hc_head was 'mean', is 'learned'"]
    assert resume_mismatches(saved, _info("--model.kpool_ape_trainable", "false")) == [
        "model.kpool_ape_trainable was True, is False"]
    both = precision_note(saved, _info("--float8.enable", "true", "--model.mhc_fp32_mixing", "true"))
    assert both is not None and "float8.enable False -> True, model.mhc_fp32_mixing False -> True" in both
    assert "from here on FP8 tensorwise" in both


def test_resume_names_the_loss_key_behind_a_derived_model_argument():
    saved = _info()
    assert resume_mismatches(saved, _info("--loss.indexer_tile_elements", "4096")) == []  # memory only
    # how the same function is split into kernels: free too
    assert resume_mismatches(saved, _info("--model.dsa_mask_query_chunk", "0", "--model.dsa_dense_max_len", "0")) == []
    assert resume_mismatches(saved, _info("--model.dsa_mask_causal_rows", "false")) == []
    assert resume_mismatches(saved, _info("--loss.mtp_weight", "0")) == [
        "loss.mtp_weight was 0.1, is 0.0 (0 trains without the MTP layer: model.num_nextn_predict_layers was 1, is 0)"]


def test_a_complete_run_says_which_new_settings_trained_nothing(tmp_path, world_of_one, caplog):
    """Re-running a finished job with other settings (the README's FP8 command after its BF16 one, same folder)
    trains nothing; it says which settings it did not train with."""
    import torch.distributed as dist

    from torchtitan_glm.train import Trainer

    argv = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "32", "--training.local_batch_size",
            "1", "--training.steps", "1", "--lr_scheduler.warmup_steps", "0", "--metrics.enable_tensorboard", "false",
            f"--job.dump_folder={tmp_path}"]
    Trainer(load_config(argv)).train()
    dist.destroy_process_group()
    with caplog.at_level("INFO", logger="torchtitan_glm.train"):
        assert Trainer(load_config([*argv, "--float8.enable", "true", "--optimizer.eps", "1e-6"])).train() == []
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("training is complete") for m in messages)
    assert "this run's settings differ from the checkpoint's (float8.enable False -> True, optimizer.eps 1e-08 -> " \
           "1e-06) and trained nothing with them: to train with them, use a new --job.dump_folder" in messages


def test_a_complete_run_writes_the_final_export_it_asks_for(tmp_path, world_of_one):
    """A finished run re-run with checkpoint.last_save_in_hf = true writes the export from its final checkpoint
    (there was no other way to get one without training more steps)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from torchtitan_glm.train import Trainer

    argv = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "32", "--training.local_batch_size",
            "1", "--training.steps", "1", "--lr_scheduler.warmup_steps", "0", "--metrics.enable_tensorboard", "false",
            f"--job.dump_folder={tmp_path}"]
    first = Trainer(load_config(argv))
    first.train()
    weights = {k: v.detach().full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
               for k, v in first.model.state_dict().items()}
    dist.destroy_process_group()
    export = tmp_path / "checkpoint" / "hf-step-1"
    assert not export.exists()
    assert Trainer(load_config([*argv, "--checkpoint.last_save_in_hf", "true"])).train() == []
    tensors = load_file(export / "model.safetensors")
    name = "model.language_model.embed_tokens.weight"
    assert torch.equal(tensors[name], weights["embed_tokens.weight"].to(tensors[name].dtype))


def test_a_fresh_start_says_what_it_passes_over_and_supersedes_old_events(tmp_path, world_of_one, caplog):
    """A fresh start in a folder of an earlier run: an HF-only final save is not resumed (the run says how to start
    from it), checkpoints with checkpointing off are not resumed (it says so), and TensorBoard shows this run's
    steps, not a mix of both runs'."""
    import torch.distributed as dist
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtitan_glm.train import Trainer

    argv = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "32", "--training.local_batch_size",
            "1", "--training.steps", "2", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
            f"--job.dump_folder={tmp_path}"]
    export_only = ["--checkpoint.last_save_in_hf", "true", "--checkpoint.last_save_model_only", "true"]
    # one step: its last event (step 1) is this run's first, which TensorBoard's own out-of-order purge misses
    first = Trainer(load_config([*argv, *export_only, "--training.steps", "1", "--optimizer.lr", "1e-2"])).train()
    dist.destroy_process_group()
    root = tmp_path / "checkpoint"
    with caplog.at_level("WARNING", logger="torchtitan_glm.train"):
        again = Trainer(load_config([*argv, "--optimizer.lr", "1e-4"])).train()
    dist.destroy_process_group()
    assert [r.getMessage() for r in caplog.records if "HF export" in r.getMessage()] == [
        f"{root} holds the HF export {root / 'hf-step-1'} of an earlier run, which a run does not resume from: this "
        f"one starts fresh; to start from those weights, set checkpoint.initial_load_path = {root / 'hf-step-1'} "
        "and checkpoint.initial_load_in_hf = true"]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(again), "the first run's events are superseded"
    assert len(first) == 1 and len(again) == 2
    caplog.clear()
    with caplog.at_level("WARNING", logger="torchtitan_glm.train"):
        Trainer(load_config([*argv, "--checkpoint.enable", "false", "--training.steps", "1"])).train()
    assert any(r.getMessage() == f"checkpoint.enable = false: the checkpoints in {root} are not resumed from (this "
               "run starts at step 1 and saves none)" for r in caplog.records)
