"""The training job end to end through torchrun (2 CPU processes, gloo): loss goes down, TensorBoard scalars are
written, a resumed run reproduces the uninterrupted one exactly, and config errors exit 2 naming the key."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| loss ([0-9.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(args: list[str], *, nproc: int = 2, script: Path = ROOT / "train.py",
             env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line of `script args` on nproc CPU ranks, and its environment (plus `env`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
           str(script), *args]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return cmd, dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", PYTHONPATH=path,
                     **(env or {}))


def _torchrun(args: list[str], *, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd, env = _command(args, nproc=nproc)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_worker_ok(script: str, *, args: list[str] | None = None, nproc: int = 2,
                  timeout: int = 300) -> subprocess.CompletedProcess:
    """A worker script of this folder on `nproc` ranks (given `args`): it must exit 0 and every rank print
    "rank <r> OK"."""
    cmd, env = _command(args or [], nproc=nproc, script=Path(__file__).with_name(script))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    assert all(f"rank {r} OK" in res.stdout for r in range(nproc)), res.stdout[-2000:]
    return res


def _kill_all(proc: subprocess.Popen, *, marker: str) -> None:
    """SIGKILL torchrun and its workers (they run in their own process groups): every process whose command line
    holds `marker`, then wait until none is left."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        alive.append(int(pid))
            except OSError:
                continue
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.time() < deadline, f"processes {alive} survived SIGKILL"
        time.sleep(0.1)


def _losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in map(STEP_LINE.match, stdout.splitlines()) if m}


def _tb_losses(folder: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("loss")}


def _run_ok(args: list[str], **kw) -> subprocess.CompletedProcess:
    res = _torchrun(args, **kw)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-6000:]}"
    return res


def test_debug_run_learns_and_writes_tensorboard(tmp_path):
    res = _run_ok(["--config", "train_configs/debug_model.toml", f"--job.dump_folder={tmp_path}",
                   "--metrics.log_freq", "1", "--checkpoint.enable", "false"])
    losses = _losses(res.stdout)
    assert sorted(losses) == list(range(1, 51))
    first, last = sum(losses[i] for i in range(1, 6)) / 5, sum(losses[i] for i in range(46, 51)) / 5
    assert last < first - 1.0, f"loss did not decrease enough: {first:.3f} -> {last:.3f}"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"loss", "mtp_loss", "indexer_kl_loss", "lr", "grad_norm", "tokens_per_sec", "tflops",
                "peak_memory_gib", "expert_load_imbalance"}
    assert expected <= tags, f"missing scalars {expected - tags}"
    assert len(acc.Scalars("loss")) == 50


SHORT = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.steps", "20", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
         "--checkpoint.enable", "true", "--checkpoint.interval", "10", "--metrics.enable_tensorboard", "true"]


def test_resume_is_exact(tmp_path, reference_run):
    full_dir, full = reference_run
    assert sorted(full) == list(range(1, 21))

    # The same 20-step job, stopped (SIGKILL) once its step-10 checkpoint is complete, then relaunched.
    part_dir = tmp_path / "part"
    ckpt_dir = part_dir / "checkpoint"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           str(ROOT / "train.py"), *SHORT, f"--job.dump_folder={part_dir}"]
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    while not (ckpt_dir / "step-10").is_dir():
        assert proc.poll() is None, "the interrupted run exited before writing its step-10 checkpoint"
        assert time.time() < deadline, "no step-10 checkpoint within the time limit"
        time.sleep(0.05)
    _kill_all(proc, marker=str(part_dir))
    for later in ckpt_dir.glob("step-*"):
        if later.name != "step-10":
            shutil.rmtree(later)  # a save that raced the kill: the job is "stopped at step 10"

    resumed = _losses(_run_ok(SHORT + [f"--job.dump_folder={part_dir}", "--metrics.save_tb_folder=tb_resumed"]).stdout)
    assert sorted(resumed) == list(range(11, 21)), "resume did not continue from step 10"
    # Bit-exact: compare the FP32 loss scalars TensorBoard recorded, not the rounded console text.
    exact_full, exact_resumed = _tb_losses(full_dir / "tb"), _tb_losses(part_dir / "tb_resumed")
    for step in range(11, 21):
        assert exact_resumed[step] == exact_full[step], (
            f"step {step}: resumed {exact_resumed[step]!r} != uninterrupted {exact_full[step]!r}")


@pytest.mark.parametrize(
    "override,key",
    [(["--training.stepz", "5"], "training.stepz"), (["--training.steps", "many"], "training.steps"),
     (["--lr_scheduler.decay_type", "exp"], "lr_scheduler.decay_type"), (["--nosuch.key", "1"], "nosuch")],
)
def test_config_errors_exit_2_naming_the_key(override, key):
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "train_configs/debug_model.toml",
                          *override], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert key in res.stderr


def test_initial_hf_load_and_final_hf_export(tmp_path):
    """Load an HF directory into the sharded model, train with a learning rate too small to move FP32 weights,
    export HF at the end: the export equals the input tensor for tensor (so both directions are exact)."""
    import torch
    from safetensors.torch import load_file

    from torchtitan_glm.models.glm5 import Glm5Model, get_flavor, save_pretrained

    torch.manual_seed(0)
    save_pretrained(Glm5Model(get_flavor("debug")), tmp_path / "hf_init")
    _run_ok(SHORT + [f"--job.dump_folder={tmp_path / 'run'}", "--training.steps", "2", "--lr_scheduler.warmup_steps",
                     "1", "--optimizer.lr", "1e-30", "--loss.router_bias_update_rate", "0",
                     f"--checkpoint.initial_load_path={tmp_path / 'hf_init'}", "--checkpoint.initial_load_in_hf",
                     "true", "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32"])
    exported = load_file(tmp_path / "run" / "checkpoint" / "hf-step-2" / "model.safetensors")
    original = load_file(tmp_path / "hf_init" / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, t in original.items():
        # Adam moves every weight by ~lr = 1e-30: invisible next to non-zero FP32 values, but zeros become ~1e-30.
        torch.testing.assert_close(exported[name], t, rtol=0, atol=1e-28, msg=name)
    # the run's tokenizer goes with the export (the byte tokenizer as an equivalent tokenizer.json)
    from torchtitan_glm.components.tokenizer import ByteTokenizer
    for name, data in ByteTokenizer().hf_files().items():
        assert (tmp_path / "run" / "checkpoint" / "hf-step-2" / name).read_bytes() == data, name


def test_dense_warmup_trains_only_the_indexer(tmp_path):
    """indexer_stage=dense_warmup: dense attention, the KL is the objective, only indexer tensors move."""
    import torch
    from safetensors.torch import load_file

    from torchtitan_glm.models.glm5 import Glm5Model, get_flavor, save_pretrained

    torch.manual_seed(0)
    save_pretrained(Glm5Model(get_flavor("debug")), tmp_path / "hf_init")
    res = _run_ok(SHORT + [f"--job.dump_folder={tmp_path / 'run'}", "--training.steps", "3",
                           "--lr_scheduler.warmup_steps", "1", "--loss.indexer_stage", "dense_warmup",
                           "--loss.router_bias_update_rate", "0",
                           f"--checkpoint.initial_load_path={tmp_path / 'hf_init'}", "--checkpoint.initial_load_in_hf",
                           "true", "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32"])
    assert "indexer_kl_loss" in res.stdout
    exported = load_file(tmp_path / "run" / "checkpoint" / "hf-step-3" / "model.safetensors")
    original = load_file(tmp_path / "hf_init" / "model.safetensors")
    moved = {name for name, t in original.items() if not torch.equal(exported[name], t)}
    indexer = {name for name in original if ".indexer." in name}
    assert moved and moved <= indexer, f"non-indexer tensors changed: {sorted(moved - indexer)[:5]}"
    assert any("wq_b" in n for n in moved) and any("weights_proj" in n for n in moved)


def test_config_error_under_torchrun_is_printed_once_per_host(tmp_path):
    res = _torchrun(["--config", "train_configs/debug_model.toml", f"--job.dump_folder={tmp_path}",
                     "--optimizer.name", "NoSuchOptimizer"], nproc=2, timeout=120)
    assert res.returncode != 0
    assert res.stderr.count("error: config error at `optimizer.name`") == 1, res.stderr[-3000:]
    assert "exitcode:2" in res.stderr.replace(" ", ""), res.stderr[-3000:]  # torchrun reports the worker's 2


def test_python_train_py_does_not_need_port_29500(tmp_path):
    """A plain `python train.py` (a world of one) picks a free port: another job holding torch's default 29500
    made it fail with a rendezvous traceback."""
    import socket

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 29500))
        holder.listen()
    except OSError:
        holder.close()
        pytest.skip("port 29500 is taken on this host already")  # the case under test, but not held by this test
    try:
        env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        env.pop("MASTER_PORT", None)
        res = subprocess.run([sys.executable, "train.py", "--config", "train_configs/debug_model.toml",
                              "--training.steps", "1", "--lr_scheduler.warmup_steps", "0", "--training.seq_len", "32",
                              "--checkpoint.enable", "false", f"--job.dump_folder={tmp_path}"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        holder.close()
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 1/1" in res.stdout + res.stderr
