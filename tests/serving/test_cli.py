"""``python -m mla_ops generate`` (``main`` in mla_ops/serving/cli.py, mla_ops/__main__.py) on
argparse's conventions: a bad argument value exits 2 with the usage and one error line on stderr;
an error while loading or generating exits 1 with one line, no traceback unless ``--debug``.

Run in-process (``main([...])``, SystemExit caught) on a tiny checkpoint written here; one real
subprocess checks the exit status and that no traceback is printed."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import mla_ops
from mla_ops.__main__ import main as package_main
from tests.support.batches import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROG = "python -m mla_ops generate"
ROOT = Path(__file__).resolve().parents[2]
CONFIG = dict(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, intermediate_size=128,
              num_hidden_layers=2, vocab_size=256, rope_interleave=False,  # the halves layout, as written here
              eos_token_id=100001)  # as tiny test models keep their tokenizer's: past the vocabulary



def write_checkpoint(path: Path, config: dict = CONFIG, weights: bool = True) -> str:
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        save_file({k: v.contiguous() for k, v in tiny_model().state_dict().items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


def files_of(path: str) -> dict:
    return {name: (Path(path) / name).read_bytes() for name in sorted(os.listdir(path))}


def run(capsys, *argv):
    """main(["generate", *argv]) -> (exit status, stdout, stderr); the argv list must stay as it was."""
    args = ["generate", *argv]
    kept = list(args)
    try:
        package_main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    assert args == kept
    out = capsys.readouterr()
    return code, out.out, out.err


def error_line(err: str) -> str:
    """The one error line: the last line of stderr, and the only one that says "error:"."""
    assert "Traceback" not in err
    lines = err.rstrip("\n").split("\n")
    assert sum("error:" in line for line in lines) == 1, err
    assert lines[-1].startswith(f"{PROG}: error: "), err
    return lines[-1]


USAGE_ERRORS = [
    (["--prompt-ids", "1,x"], "argument --prompt-ids: 'x' is not a token id in '1,x'"),
    (["--prompt-ids", ""], "argument --prompt-ids: empty"),
    (["--prompt-ids", " , "], "argument --prompt-ids: an empty token id"),
    (["--prompt-ids", "1,,2"], "argument --prompt-ids: an empty token id between commas in '1,,2'"),
    (["--prompt-ids=-1,2"], "argument --prompt-ids: token ids must be >= 0, got -1"),
    (["--prompt-ids", "1.5"], "'1.5' is not a token id"),
    (["--prompt-ids", "1 256"], r"argument --prompt-ids: token id 256 is past the vocabulary of .* \(vocab_size 256"),
    (["--prompt-ids", "1", "--prompt-ids", "300,2"], "token id 300 is past the vocabulary"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be an int >= 0, got -1"),
    (["--max-new-tokens", "two"], "argument --max-new-tokens: must be an int, got 'two'"),
    (["--block-size", "0"], "argument --block-size: must be an int >= 1, got 0"),
    (["--dtype", "float31"], "argument --dtype: unknown dtype 'float31': choose from float32, bfloat16"),
    (["--dtype", "int8"], "argument --dtype: unknown dtype 'int8'"),
    (["--device", "nonsense"], "argument --device: unknown device 'nonsense'"),
    (["--device", "meta"], "argument --device: device 'meta': meta tensors hold no values"),
    (["--absorb-max-query-len", "-1"], "argument --absorb-max-query-len: must be an int >= 0, got -1"),
    (["--prompt", "hello"], "--prompt needs .*tokenizer.json"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    ([], "give at least one --prompt or --prompt-ids"),
]


@pytest.mark.parametrize("argv, words", USAGE_ERRORS, ids=[" ".join(a) or "no prompt" for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_line(capsys, checkpoint, argv, words):
    before = files_of(checkpoint)
    needs_prompt = not any(a.startswith(("--prompt", "--bogus")) for a in argv) and argv
    code, out, err = run(capsys, "--model", checkpoint, *argv, *(["--prompt-ids", "1"] if needs_prompt else []))
    assert code == 2 and out == ""
    line = error_line(err)
    assert re.search(words, line), line
    assert all(x.startswith(("usage:", " ")) for x in err.rstrip("\n").split("\n")[:-1])  # argparse's usage
    assert "config.json" not in line or "tokenizer" in line  # --dtype's used to blame config.json
    assert files_of(checkpoint) == before


def test_model_directory_errors_exit_2(capsys, tmp_path):
    for model, words in ((tmp_path / "nowhere", "is not a directory"), (tmp_path, "has no config.json")):
        code, out, err = run(capsys, "--model", str(model), "--prompt-ids", "1")
        assert code == 2 and out == "" and f"argument --model: '{model}' {words}" in error_line(err)
    code, _, err = run(capsys, "--prompt-ids", "1")
    assert code == 2 and "the following arguments are required: --model" in error_line(err)


def test_runtime_errors_exit_1_with_one_line_and_debug_raises(capsys, checkpoint, tmp_path):
    no_weights = write_checkpoint(tmp_path / "no_weights", weights=False)
    not_json = tmp_path / "not_json"
    shutil.copytree(checkpoint, not_json)
    (not_json / "config.json").write_text("{vocab_size: 256")
    bad_eos = tmp_path / "bad_eos"
    shutil.copytree(checkpoint, bad_eos)
    (bad_eos / "config.json").write_text(json.dumps(dict(CONFIG, eos_token_id="2")))
    for model, words in ((no_weights, "has neither model.safetensors nor model.safetensors.index.json"),
                         (not_json, "config.json is not valid JSON"),
                         (bad_eos, "config.json's eos_token_id must be None, an int, or a list/tuple/set of ints, "
                                   "got str '2'")):
        before = files_of(model)
        code, out, err = run(capsys, "--model", str(model), "--prompt-ids", "1,2")
        assert code == 1 and out == ""
        assert words in error_line(err) and error_line(err).endswith("(--debug shows the traceback)")
        assert files_of(model) == before
    with pytest.raises(ValueError, match="has neither model.safetensors"):
        package_main(["generate", "--model", no_weights, "--prompt-ids", "1,2", "--debug"])


def test_prompt_ids_take_commas_and_spaces(capsys, checkpoint):
    model = mla_ops.MLAForCausalLM.from_pretrained(checkpoint)
    expect = mla_ops.Generator(model).generate([[2, 3, 4], [234]], 4)
    assert expect[0] != expect[1]
    code, out, err = run(capsys, "--model", checkpoint, "--prompt-ids", "2 3 4", "--prompt-ids", "2,3,4",
                         "--prompt-ids", " 2, 3 ,4 ", "--prompt-ids", "234", "--max-new-tokens", "4")
    assert code == 0 and "Traceback" not in err
    assert out.split("\n") == [",".join(map(str, expect[0]))] * 3 + [",".join(map(str, expect[1])), ""]
    assert "16/16 tokens" in err and "prompt tokens 10" in err
    assert "note: config.json's eos_token_id 100001 is past the vocabulary (vocab_size 256)" in err
    assert "separated by commas and/or spaces" in package_help(capsys)


def package_help(capsys) -> str:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    return " ".join(out.split())


def test_zero_new_tokens_prints_nothing_odd(capsys, checkpoint):
    code, out, err = run(capsys, "--model", checkpoint, "--prompt-ids", "5,6", "--prompt-ids", "7",
                         "--max-new-tokens", "0", "--ignore-eos")
    assert code == 0 and out == "\n\n"  # one (empty) line per prompt
    assert "Traceback" not in err and "Error" not in err and "tok/s" not in err and "[" not in err
    assert err.rstrip("\n").split("\n")[-1] == "0 tokens in 0.00 s (0 steps); prompt tokens 3, cached 0 (0%)"


def test_package_entry_point(capsys):
    for argv, status in (([], 2), (["bogus"], 2), (["-h"], 0)):
        with pytest.raises(SystemExit) as exit_:
            package_main(argv)
        assert exit_.value.code == status
        out = capsys.readouterr()
        if status:
            assert out.out == "" and out.err.rstrip("\n").split("\n")[-1].startswith("python -m mla_ops: error: ")
        else:
            assert out.out.startswith("usage: python -m mla_ops {demo,generate}") and out.err == ""


def test_a_real_process_exits_1_without_a_traceback(tmp_path):
    no_weights = write_checkpoint(tmp_path / "no_weights", weights=False)
    done = subprocess.run([sys.executable, "-m", "mla_ops", "generate", "--model", no_weights, "--prompt-ids", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"{PROG}: error: {no_weights} has neither model.safetensors")


def test_absorb_max_query_len_routes_every_step_to_the_chunk_loop(capsys, checkpoint):
    code, routed, _ = run(capsys, "--model", checkpoint, "--prompt-ids", "2,3,4", "--max-new-tokens", "3")
    assert code == 0
    code, out, err = run(capsys, "--model", checkpoint, "--prompt-ids", "2,3,4", "--max-new-tokens", "3",
                         "--absorb-max-query-len", "0")
    assert code == 0 and out == routed and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_the_machine_lacks_is_a_usage_error(capsys, checkpoint):
    for device in ("cuda", "cuda:1"):
        code, out, err = run(capsys, "--model", checkpoint, "--prompt-ids", "1", "--device", device)
        assert code == 2 and out == ""
        assert f"argument --device: device '{device}': CUDA is not available here" in error_line(err)


DEMO = "python -m mla_ops demo"


def test_demo_refuses_a_backend_the_machine_lacks_in_one_line(capsys, monkeypatch):
    """Checked before anything runs: the demo's tensors are on the CPU, where Triton needs its
    interpreter (and the triton package)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_:
        package_main(["demo", "--backend", "triton"])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == "" and "Traceback" not in out.err
    last = out.err.rstrip("\n").split("\n")[-1]
    assert last.startswith(f"{DEMO}: error: argument --backend: backend='triton' ")
    assert "TRITON_INTERPRET=1" in last or "needs the triton package" in last


def test_demo_errors_while_running_exit_1_with_one_line(capsys, monkeypatch):
    from mla_ops import demo

    def fail(**kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(demo, "run", fail)
    with pytest.raises(SystemExit) as exit_:
        package_main(["demo"])
    out = capsys.readouterr()
    assert exit_.value.code == 1 and "Traceback" not in out.err
    assert out.err == (f"{DEMO}: error: RuntimeError: no kernel image is available for execution on the device "
                       "(--debug shows the traceback)\n")
    with pytest.raises(RuntimeError, match="no kernel image"):
        package_main(["demo", "--debug"])


def test_demo_on_a_real_process_exits_2_without_a_traceback():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "mla_ops", "demo", "--backend", "triton"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(env, OMP_NUM_THREADS="1"))
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.rstrip("\n").split("\n")[-1].startswith(f"{DEMO}: error: argument --backend:")
