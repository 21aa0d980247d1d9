"""examples/train_moe.py: a few steps end to end (CSV + PNG written, training bitwise reproducible)."""

from __future__ import annotations

import csv
import importlib.util
import math
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (it is in megamoe's 'test' extra)")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (it is in megamoe's 'test' extra)")
pytest.importorskip("tqdm", reason="tqdm is not installed (a dependency of megamoe)")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
SMALL = ["--steps", "5", "--batch-size", "4", "--seq-len", "32", "--no-progress", "--check-determinism"]


def _run(command: list[str], timeout: int = 240) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _check_outputs(out_dir: pathlib.Path, stdout: str, steps: int = 5) -> None:
    assert "losses bitwise identical across 2 runs: True" in stdout, f"determinism check did not pass:\n{stdout}"
    with open(out_dir / "loss.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(steps)), f"loss.csv steps: {[r['step'] for r in rows]}"
    losses = [float(r["loss"]) for r in rows]
    assert all(0 < loss < 10 for loss in losses), f"loss.csv losses out of range: {losses}"
    png = (out_dir / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG"), "loss.png is not a PNG file"


def test_single_process(tmp_path):
    stdout = _run([sys.executable, str(EXAMPLE), *SMALL, "--out-dir", str(tmp_path)])
    _check_outputs(tmp_path, stdout)


def test_torchrun_data_and_expert_parallel(tmp_path):
    """2 ranks, DDP over data + experts sharded over the ranks, the gradient clipped (parallel.clip_grad_norm_ over
    patched experts); the saved checkpoint loads in transformers."""
    transformers = pytest.importorskip("transformers")
    stdout = _run([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
        *SMALL, "--expert-parallel", "--save-model", "--max-grad-norm", "0.5", "--out-dir", str(tmp_path),
    ])
    _check_outputs(tmp_path, stdout)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.shape[0] == model.config.num_experts, f"saved gate_up_proj has shape {tuple(gate_up.shape)}"


def test_check_determinism_takes_a_run_that_diverged_alike_twice_as_reproducible(tmp_path):
    """Losses and weights are compared bit for bit: two runs that reach NaN alike are identical (torch.equal and ==
    compare values, NaN != NaN, and reported them as not reproducible, exiting 1)."""
    stdout = _run([sys.executable, str(EXAMPLE), "--steps", "3", "--warmup", "0", "--batch-size", "2", "--seq-len", "16",
                   "--lr", "1e30", "--no-progress", "--check-determinism", "--out-dir", str(tmp_path)])
    with open(tmp_path / "loss.csv", newline="") as f:
        last = float(list(csv.DictReader(f))[-1]["loss"])
    assert math.isnan(last), f"the run did not diverge (final loss {last}): lower --lr's reach in this test"
    assert "losses bitwise identical across 2 runs: True; final parameters identical: True" in stdout, stdout


def _parse_args(argv: list[str]):
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(argv)


BAD_OPTIONS = [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--experts", "0"], "--experts must be >= 1, got 0"),
    (["--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["--expert-intermediate", "0"], "--expert-intermediate must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--top-k", "9"], "--top-k 9: more than --experts 8"),
    (["--seq-len", "1000000"], "--seq-len 1000000: longer than the corpus allows"),
    (["--corpus", "no-such-corpus.txt"], "--corpus no-such-corpus.txt: cannot read"),
    (["--corpus", "."], "--corpus .: cannot read (Is a directory)"),
    (["--hidden", "0"], "--hidden 0: its 4 attention heads get hidden // 4 = 0 dims each"),
    (["--hidden", "36"], "--hidden 36: its 4 attention heads get hidden // 4 = 9 dims each"),
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    (["--backend", "fused"], "argument --backend: invalid choice: 'fused'"),
    (["--backend", "triton", "--device", "cpu"], "--backend triton: the fused kernels need an NVIDIA GPU and this run"),
    (["--lr", "-0.1"], "--lr must be >= 0, got -0.1"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be >= 0, got -1.0"),
    (["--max-grad-norm", "nan"], "--max-grad-norm must be >= 0, got nan"),
]


def test_an_out_dir_that_cannot_be_made_fails_before_training(tmp_path, capsys):
    """The outputs are written after training: a folder that cannot hold them is a usage error up front."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(["--out-dir", str(blocker / "out")])
    assert exit_info.value.code == 2 and f"--out-dir {blocker / 'out'}: cannot write there" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu_is_a_usage_error(capsys):
    """Not an AttributeError from torch.cuda.set_device in setup_distributed."""
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(["--device", "cuda"])
    assert exit_info.value.code == 2 and "--device cuda: torch finds no CUDA GPU here" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=[" ".join(argv) for argv, _ in BAD_OPTIONS])
def test_bad_options_are_usage_errors(argv, message, capsys):
    """Options the run cannot use are rejected up front, naming the option (not an IndexError after training or
    a torch error from deep inside the model)."""
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
