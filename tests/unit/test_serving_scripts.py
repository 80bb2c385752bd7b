"""scripts/generate.py (DCP and HF checkpoints) and scripts/rollout_agreement.py on the debug model, CPU."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from torchtitan_glm.components.checkpoint import CheckpointManager, list_checkpoints
from torchtitan_glm.components.resume import run_info
from torchtitan_glm.config import CheckpointConfig, JobConfig
from torchtitan_glm.generation import generate
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor, save_pretrained

from tests.decode_util import randomize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Loader:
    """The data loader's checkpoint interface (its position), all the manager needs of it."""

    def state_dict(self) -> dict[str, int]:
        return {"pos": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        del state


def _debug_model() -> Glm5Model:
    torch.manual_seed(0)
    return randomize(Glm5Model(get_flavor("debug")), seed=1, scale=0.2).eval()


@torch.no_grad()
def test_generate_script_from_a_trainer_checkpoint(tmp_path, capsys):
    """A checkpoint saved by the trainer's CheckpointManager (DCP + run.json + manifest): the script rebuilds the
    model from run.json, tokenises with the run's byte tokenizer, streams the text and prints the ids, which are the
    generate() API's on the same weights."""
    model = _debug_model()
    cfg = JobConfig()
    opt = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(cfg=CheckpointConfig(enable=True, interval=1), dump_folder=str(tmp_path), model=model,
                                optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                                dataloader=_Loader(),
                                run_info=run_info(cfg=cfg, args=model.args, tokenizer_vocab_size=259))
    manager.save(3)
    root = os.path.join(str(tmp_path), cfg.checkpoint.folder)
    assert list_checkpoints(root) == [3]
    prompt = "def main(argv):\n    "
    ids = _script("generate").main(["--checkpoint", root, "--prompt", prompt, "--max-new-tokens", "12",
                                    "--ignore-eos", "--print-ids"])
    expected = list(prompt.encode()) + generate(model, torch.tensor([list(prompt.encode())]),
                                                max_new_tokens=12)[0, -12:].tolist()
    assert ids == expected
    out = capsys.readouterr().out
    text = bytes(i for i in expected if i < 256).decode("utf-8", errors="replace")
    assert out.startswith(text.rstrip("\ufffd")[:len(prompt)])
    assert f"ids: {','.join(map(str, expected))}" in out


@torch.no_grad()
def test_generate_script_from_hf_with_ids_and_sampling(tmp_path, capsys):
    model = _debug_model()
    save_pretrained(model, tmp_path / "hf")
    ids = _script("generate").main(["--hf", str(tmp_path / "hf"), "--prompt-ids", "5,17,300,2",
                                    "--max-new-tokens", "5", "--temperature", "0.8", "--top-p", "0.9",
                                    "--seed", "3", "--print-ids"])
    gen = torch.Generator().manual_seed(3)
    expected = generate(model, torch.tensor([[5, 17, 300, 2]]), max_new_tokens=5, temperature=0.8, top_p=0.9,
                        generator=gen)[0].tolist()
    assert ids == expected
    assert capsys.readouterr().out.strip() == "ids: " + ",".join(map(str, expected))
    with pytest.raises(SystemExit):  # no tokenizer in the folder: text prompts are refused
        _script("generate").main(["--hf", str(tmp_path / "hf"), "--prompt", "hi"])
    assert "no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("args,words", [
    (["--temperature", "-1"], "--temperature"), (["--top-p", "0"], "--top-p"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"), (["--tokenizer", "/nonexistent/tok.json"], "--tokenizer"),
])
def test_generate_script_refuses_bad_arguments_before_loading(tmp_path, capsys, args, words):
    model = _debug_model()
    save_pretrained(model, tmp_path / "hf")
    with pytest.raises(SystemExit) as info:
        _script("generate").main(["--hf", str(tmp_path / "hf"), "--prompt-ids", "5,17", *args])
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_generate_script_names_a_missing_checkpoint_and_stops_at_eos_id(tmp_path, capsys):
    for flag in ("--hf", "--checkpoint"):
        with pytest.raises(SystemExit) as info:
            _script("generate").main([flag, str(tmp_path / "nope"), "--prompt-ids", "5"])
        assert info.value.code == 2 and "does not exist" in capsys.readouterr().err
    model = _debug_model()
    save_pretrained(model, tmp_path / "hf")
    full = generate(model, torch.tensor([[5, 17, 300, 2]]), max_new_tokens=6)[0, 4:].tolist()
    stop = full[2]
    ids = _script("generate").main(["--hf", str(tmp_path / "hf"), "--prompt-ids", "5,17,300,2", "--max-new-tokens",
                                    "6", "--eos-id", str(stop)])
    assert ids[4:] == full[:full.index(stop) + 1]  # generation ends at the first eos, which it emits


def test_generate_script_points_a_checkpoint_folder_of_hf_exports_to_hf(tmp_path, capsys):
    """checkpoint.last_save_model_only leaves only hf-step-N in the folder: the error names the newest and --hf."""
    save_pretrained(_debug_model(), tmp_path / "checkpoint" / "hf-step-2")
    save_pretrained(_debug_model(), tmp_path / "checkpoint" / "hf-step-10")
    with pytest.raises(SystemExit) as info:
        _script("generate").main(["--checkpoint", str(tmp_path / "checkpoint"), "--prompt-ids", "5"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and f"try --hf {tmp_path / 'checkpoint' / 'hf-step-10'}" in err


def test_rollout_agreement_script_json(tmp_path):
    """The report's documented fields; FP32 paths agree to rounding and select the same pools; serving's FP8
    indexer against an unemulated actor is a real perturbation (random weights of a useful size, from --hf)."""
    save_pretrained(_debug_model(), tmp_path / "hf")
    out = tmp_path / "agreement.json"
    result = _script("rollout_agreement").main([
        "--hf", str(tmp_path / "hf"), "--device", "cpu", "--precisions", "fp32,fp8_indexer", "--num-sequences", "3",
        "--prompt-len", "30", "--continuation-len", "10", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    assert {"model", "device", "sequences", "prompt_tokens", "continuation_tokens", "variants"} <= set(data)
    assert data["prompt_tokens"] == [30, 29, 28] and data["continuation_tokens"] == 10
    rollout = _script("rollout_agreement")
    for name in ("fp32", "fp8_indexer"):
        r = data["variants"][name]
        assert set(r) == set(rollout.FIELDS) and r["tokens"] == 30
        assert len(r["indexer_overlap"]) == 1  # the debug model has one DSA layer
    fp32 = data["variants"]["fp32"]
    assert fp32["pearson"] > 0.999999 and fp32["max_abs_diff"] < 1e-4 and fp32["top1_agreement"] == 1.0
    assert fp32["indexer_overlap"] == [1.0]
    assert data["variants"]["fp8_indexer"]["max_abs_diff"] > fp32["max_abs_diff"]


def test_rollout_agreement_jsonl_input(tmp_path):
    path = tmp_path / "seqs.jsonl"
    path.write_text(json.dumps({"prompt": list(range(40, 61)), "continuation": [7, 8, 9, 10, 11]}) + "\n"
                    + json.dumps({"prompt": "import os\n", "continuation": "import sys"}) + "\n")
    result = _script("rollout_agreement").main(["--flavor", "debug", "--device", "cpu", "--precisions", "fp32",
                                                "--jsonl", str(path), "--tokenizer", "byte"])
    assert result["prompt_tokens"] == [21, 10] and result["continuation_tokens"] == 5  # cut to the shortest
    assert result["variants"]["fp32"]["pearson"] > 0.999999
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit, match="seqs.jsonl:1"):
        _script("rollout_agreement").main(["--flavor", "debug", "--device", "cpu", "--precisions", "fp32",
                                           "--jsonl", str(path)])


@pytest.mark.parametrize("args,words", [
    (["--num-sequences", "0"], "--num-sequences"), (["--continuation-len", "0"], "--continuation-len"),
    (["--prompt-len", "-5"], "--prompt-len"), (["--jsonl", "/nonexistent/x.jsonl"], "--jsonl"),
    (["--flavor", "nonexist"], "--flavor"), (["--hf", "/nonexistent/hf"], "--hf"),
    (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint"), (["--tokenizer", "/nonexistent/t.json"], "--tokenizer"),
])
def test_rollout_agreement_refuses_bad_arguments(capsys, args, words):
    with pytest.raises(SystemExit) as info:
        _script("rollout_agreement").main(["--flavor", "debug", "--device", "cpu", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and words in err[-1] and "Traceback" not in "\n".join(err)


def test_rollout_agreement_text_prompts_use_the_checkpoints_tokenizer(tmp_path, capsys):
    """Text in --jsonl without --tokenizer: the --hf export's tokenizer.json, or the DCP run's data.tokenizer (here
    'byte'), as generate.py finds them."""
    from tests.unit.test_tokenizer import _train_tiny_tokenizer
    from torchtitan_glm.components.tokenizer import HFTokenizer

    lines = tmp_path / "seqs.jsonl"
    lines.write_text(json.dumps({"prompt": "hello world, hello", "continuation": " tokenizer"}) + "\n")
    model = _debug_model()
    save_pretrained(model, tmp_path / "hf")
    _train_tiny_tokenizer(tmp_path / "hf" / "tokenizer.json")
    tok = HFTokenizer(str(tmp_path / "hf"))
    result = _script("rollout_agreement").main(["--hf", str(tmp_path / "hf"), "--device", "cpu", "--precisions",
                                                "fp32", "--jsonl", str(lines)])
    assert result["prompt_tokens"] == [len(tok.encode("hello world, hello"))]
    assert result["continuation_tokens"] == len(tok.encode(" tokenizer"))
    cfg = JobConfig()
    opt = torch.optim.AdamW(model.parameters())
    CheckpointManager(cfg=CheckpointConfig(enable=True, interval=1), dump_folder=str(tmp_path), model=model,
                      optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      dataloader=_Loader(),
                      run_info=run_info(cfg=cfg, args=model.args, tokenizer_vocab_size=259)).save(1)
    result = _script("rollout_agreement").main(["--checkpoint", os.path.join(str(tmp_path), cfg.checkpoint.folder),
                                                "--device", "cpu", "--precisions", "fp32", "--jsonl", str(lines)])
    assert result["prompt_tokens"] == [len("hello world, hello")]  # the run's byte tokenizer


def test_rollout_agreement_pearson_of_one_token_is_undefined(tmp_path, capsys):
    """One sequence, one continuation token: one log-prob per path, no correlation: n/a with the reason, not 0."""
    lines = tmp_path / "seqs.jsonl"
    lines.write_text(json.dumps({"prompt": [40, 41, 42, 43], "continuation": [7]}) + "\n")
    result = _script("rollout_agreement").main(["--flavor", "debug", "--device", "cpu", "--precisions", "fp32",
                                                "--jsonl", str(lines)])
    r = result["variants"]["fp32"]
    assert r["tokens"] == 1 and r["pearson"] is None and "needs >= 2" in r["pearson_undefined"]
    out = capsys.readouterr().out
    assert "n/a" in out and "needs >= 2" in out and "0.000000" not in out
    rollout = _script("rollout_agreement")
    x = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    assert rollout._pearson(x, x + torch.tensor([0.0, 0.1, 0.2], dtype=torch.float64)) == (None, "constant log-probs")


def test_rollout_agreement_names_ids_outside_the_vocabulary(tmp_path, capsys):
    save_pretrained(_debug_model(), tmp_path / "hf")
    lines = tmp_path / "seqs.jsonl"
    lines.write_text('{"prompt": [1, 2, 3], "continuation": [6, 7]}\n{"prompt": [1, 2, -3], "continuation": [6, 7]}\n')
    with pytest.raises(SystemExit) as info:
        _script("rollout_agreement").main(["--hf", str(tmp_path / "hf"), "--device", "cpu", "--jsonl", str(lines)])
    assert info.value.code == 2 and "sequences [1]" in capsys.readouterr().err
