"""config.py: TOML + CLI merging, typing, validation errors that name the key and the file, exit codes."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from torchtitan_glm.config import (
    ConfigError,
    DataConfig,
    JobConfig,
    LRSchedulerConfig,
    TrainingConfig,
    load_config,
    main_guard,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_are_valid_and_frozen():
    cfg = load_config([])
    assert cfg == JobConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.steps = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training = TrainingConfig()  # type: ignore[misc]


def test_toml_then_cli_precedence_and_typing(tmp_path):
    path = write(tmp_path, """
        [training]
        steps = 100
        max_norm = 2          # an int is accepted for a float key
        [lr_scheduler]
        warmup_steps = 5
        [compile]
        components = ["model"]
        [job]
        description = "from file"
    """)
    cfg = load_config(["--config", path, "--training.steps", "200", "--training.seq_len=64",
                       "--compile.components=model,loss", "--training.deterministic", "--checkpoint.enable", "0"])
    assert cfg.training.steps == 200 and cfg.training.seq_len == 64
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.lr_scheduler.warmup_steps == 5
    assert cfg.compile.components == ["model", "loss"]
    assert cfg.training.deterministic is True and cfg.checkpoint.enable is False
    assert cfg.job.description == "from file"
    assert load_config(["--config=" + path]).training.steps == 100
    # negative numbers are values, not options
    assert load_config(["--parallelism.data_parallel_shard_degree", "-1"]).parallelism.data_parallel_shard_degree == -1


@pytest.mark.parametrize("value,expected", [("true", True), ("False", False), ("1", True), ("0", False)])
def test_cli_bool_spellings(value, expected):
    assert load_config([f"--training.deterministic={value}"]).training.deterministic is expected


@pytest.mark.parametrize("value,expected", [("none", None), ("", None), ("TRUE", True), ("0", False)])
def test_cli_optional_bool_takes_none_and_names_it_in_errors(value, expected):
    key = "--parallelism.fsdp_reduce_in_compute_pool"
    assert load_config([f"{key}={value}"]).parallelism.fsdp_reduce_in_compute_pool is expected
    with pytest.raises(ConfigError,
                       match=r"fsdp_reduce_in_compute_pool.*expected bool \(true/false\) or none, got 'maybe'"):
        load_config([key, "maybe"])


BAD_TOML = [
    ("[training]\nstepz = 3\n", "training.stepz", "did you mean `training.steps`"),
    ("[trainin]\nsteps = 3\n", "trainin", "unknown section"),
    ('[training]\nsteps = "ten"\n', "training.steps", "expected integer"),
    ("[training]\nsteps = 1.5\n", "training.steps", "expected integer"),
    ("[training]\ndeterministic = 1\n", "training.deterministic", "expected bool"),
    ('[compile]\ncomponents = "model"\n', "compile.components", "list of strings"),
    ("[training]\nsteps = -4\n", "training.steps", "must be >= 1"),
    ("[training]\nseq_len = 0\n", "training.seq_len", "must be > 0"),
    ('[lr_scheduler]\ndecay_type = "cos"\n', "lr_scheduler.decay_type", "must be one of"),
    ("[training]\nsteps = 10\n[lr_scheduler]\nwarmup_steps = 11\n", "lr_scheduler.warmup_steps", "exceed"),
    ('[lr_scheduler]\ndecay_type = "wsd"\ndecay_ratio = 0.01\n', "lr_scheduler.decay_ratio", "wsd"),
    ("[checkpoint]\ninitial_load_in_hf = true\n", "checkpoint.initial_load_in_hf", "initial_load_path is empty"),
    ("[checkpoint]\nlast_save_in_hf = true\n", "checkpoint.last_save_in_hf", "enable is false"),
    ("[checkpoint]\nenable = true\nlast_save_model_only = true\n", "checkpoint.last_save_model_only",
     "last_save_in_hf is false"),
    ('[loss]\nindexer_stage = "dense_warmup"\nindexer_sparse_loss = true\n', "loss.indexer_sparse_loss", "sparse"),
    ('[data]\nsource = "jsonl"\n', "data.paths", "at least one"),
    ('[data]\nsource = "jsonl"\npaths = ["/nonexistent/x.jsonl"]\n', "data.paths", "/nonexistent/x.jsonl"),
    ('[model]\nflavor = "huge"\n', "model.flavor", "must be one of"),
    ('[compile]\ncomponents = ["model", "optimizer"]\n', "compile.components", "optimizer"),
    ("[optimizer]\nbeta2 = 1.0\n", "optimizer.beta2", "[0, 1)"),
    ("training = 3\n", "training", "expected a table"),
]


@pytest.mark.parametrize("text,key,fragment", BAD_TOML)
def test_toml_errors_name_key_and_file(tmp_path, text, key, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path])
    msg = str(info.value)
    assert info.value.key == key
    assert f"`{key}`" in msg and path in msg and fragment in msg


@pytest.mark.parametrize("argv,key", [
    (["--training.steps", "-1"], "training.steps"),
    (["--training.steps", "x"], "training.steps"),
    (["--training.deterministic=maybe"], "training.deterministic"),
    (["--training.stepz", "3"], "training.stepz"),
    (["--lr_scheduler.decay_type", "exp"], "lr_scheduler.decay_type"),
    (["--training.steps"], "training.steps"),  # a non-bool key needs a value
])
def test_cli_errors_name_key_file_and_command_line(tmp_path, argv, key):
    path = write(tmp_path, "[training]\nsteps = 20\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path, *argv])
    msg = str(info.value)
    assert f"`{key}`" in msg and "command line" in msg and path in msg


def test_bad_argv_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="unexpected command-line argument"):
        load_config(["stray"])
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config(["--config", str(tmp_path / "missing.toml")])
    broken = write(tmp_path, "[training\nsteps = 1\n", "broken.toml")
    with pytest.raises(ConfigError, match="broken.toml is not valid TOML"):
        load_config(["--config", broken])


def test_default_value_errors_mention_the_file(tmp_path):
    # warmup default (2) exceeds steps=1 set in the file: the message still names the file
    path = write(tmp_path, "[training]\nsteps = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path])
    assert info.value.key == "lr_scheduler.warmup_steps" and path in str(info.value)


def test_print_config_round_trips(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--training.steps", "77", "--data.paths=", "--job.description", 'a "quoted" text',
                     "--compile.components", "loss", "--print-config"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "[training]" in out and "steps = 77" in out
    path = write(tmp_path, out, "printed.toml")
    cfg = load_config(["--config", path])
    assert cfg.training.steps == 77 and cfg.job.description == 'a "quoted" text'
    assert cfg.compile.components == ["loss"]
    assert cfg == load_config(["--training.steps", "77", "--job.description", 'a "quoted" text',
                               "--compile.components", "loss"])


def test_help_section_prints_what_each_key_means(capsys):
    """`--help SECTION`: the section's docstring (each key's meaning) above its keys, and nothing of the other
    sections; an unknown section exits 2 naming it, with the closest one."""
    with pytest.raises(SystemExit) as info:
        load_config(["--help", "optimizer"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "implementation: for AdamW" in out and "--optimizer.implementation (string" in out
    assert "--training.steps" not in out and "[training]" not in out
    with pytest.raises(ConfigError) as e:
        load_config(["--help", "optimiser"])
    assert e.value.key == "--help" and "did you mean 'optimizer'" in str(e.value)


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        for f in dataclasses.fields(cls()):
            if f.type not in ("dict", dict):
                assert f"--{section.name}.{f.name} " in out
        for key in cls.extra_keys():
            assert f"--{section.name}.{key} " in out
        assert f"[{section.name}] " in out  # headed by its docstring's first line


def test_every_key_is_documented_in_its_section_docstring():
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        doc = cls.__doc__ or ""
        assert f"[{section.name}]" in doc, cls
        for f in dataclasses.fields(cls):
            assert f.name in doc, f"{section.name}.{f.name} missing from {cls.__name__} docstring"


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="data.source"):
        JobConfig(data=DataConfig(source="parquet")).validate()
    with pytest.raises(ConfigError, match="training.steps"):
        JobConfig(training=TrainingConfig(steps="3")).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lr_scheduler.min_lr_factor"):
        JobConfig(lr_scheduler=LRSchedulerConfig(min_lr_factor=1.5)).validate()


def test_main_guard_exits_2_in_process(capsys):
    @main_guard
    def main(argv):
        load_config(argv)
        raise AssertionError("unreachable: config is invalid")

    with pytest.raises(SystemExit) as info:
        main(["--training.seq_len", "0"])
    assert info.value.code == 2
    assert "training.seq_len" in capsys.readouterr().err
    assert main_guard(lambda: 5)() == 5


def test_main_guard_exit_code_in_subprocess(tmp_path):
    path = write(tmp_path, "[training]\nstepz = 3\n")
    code = ("import sys; from torchtitan_glm.config import load_config, main_guard; "
            "main_guard(load_config)(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, "--config", path], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "training.stepz" in proc.stderr and path in proc.stderr
    assert "Traceback" not in proc.stderr


def test_reliability_keys_are_validated():
    assert load_config(["--training.on_nonfinite", "skip", "--data.errors", "skip", "--checkpoint.load_step", "4"])
    for argv, key in ((["--training.on_nonfinite", "ignore"], "training.on_nonfinite"),
                      (["--training.max_consecutive_nonfinite", "0"], "training.max_consecutive_nonfinite"),
                      (["--data.errors", "ignore"], "data.errors"),
                      (["--checkpoint.load_step", "0"], "checkpoint.load_step")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(argv)


def test_hf_dir_that_is_not_glm5_next_says_so(tmp_path):
    """A Llama checkpoint given as the initial HF load: the error says what it is, not a model-argument detail."""
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_key_value_heads": 8, '
                                          '"num_attention_heads": 32}')
    with pytest.raises(ConfigError) as info:
        load_config([f"--checkpoint.initial_load_path={tmp_path}", "--checkpoint.initial_load_in_hf"])
    assert info.value.key == "checkpoint.initial_load_path"
    assert "model_type 'llama': this is not a glm5_next checkpoint" in str(info.value)
    (tmp_path / "config.json").write_text('{"model_type": "glm5_next_text"}')
    assert load_config([f"--checkpoint.initial_load_path={tmp_path}", "--checkpoint.initial_load_in_hf"])


def test_cli_list_takes_commas_or_a_toml_array():
    for text in ('kda,mhc', '["kda", "mhc"]', "['kda','mhc']"):
        cfg = load_config(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.recompute_modules",
                           text])
        assert cfg.activation_checkpoint.recompute_modules == ["kda", "mhc"], text
    assert load_config(["--float8.keep_bf16", "[]"]).float8.keep_bf16 == []
    for bad in ('["kda", 3]', '["kda"'):
        with pytest.raises(ConfigError) as info:
            load_config(["--activation_checkpoint.recompute_modules", bad])
        assert info.value.key == "activation_checkpoint.recompute_modules", info.value


def test_help_float8_names_every_keep_bf16_role(capsys):
    """`--help float8` lists the roles keep_bf16 accepts by name (the docstring and FLOAT8_ROLES stay in step)."""
    import re

    from torchtitan_glm.config import FLOAT8_ROLES

    with pytest.raises(SystemExit):
        load_config(["--help", "float8"])
    doc = capsys.readouterr().out.split("[float8]\n")[0]
    assert "FLOAT8_ROLES" not in doc
    assert all(re.search(rf"\b{role}\b", doc) for role in FLOAT8_ROLES), doc


def test_main_guard_quiet_rank_waits_for_torchrun_to_stop_it(monkeypatch, capsys):
    """Under torchrun a rank other than the host's first does not print and does not exit first: torchrun stops the
    other workers when one exits, which silenced the printing rank when a quiet one won the race."""
    import torchtitan_glm.config as config_module

    slept = []
    monkeypatch.setattr(config_module.time, "sleep", slept.append)
    guarded = main_guard(lambda: load_config(["--training.seq_len", "0"]))
    for env, want_sleep, want_line in (({"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, [30.0], False),
                                       ({"LOCAL_RANK": "1"}, [], False),  # not torchrun: nothing stops it
                                       ({"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, [], True)):
        slept.clear()
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit) as info:
            guarded()
        assert info.value.code == 2 and slept == want_sleep
        assert ("training.seq_len" in capsys.readouterr().err) == want_line
