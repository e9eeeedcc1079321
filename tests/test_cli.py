"""The command line: tree, plan, demo, examples, and one-line errors for bad targets."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from autoremat.cli import main


def test_tree_prints_paths_and_shapes(capsys):
    assert main(["tree", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "  h.0: Block (float32[8, 128, 128]) -> (float32[8, 128, 128])" in out
    assert "*" not in out.split(":")[0]


def test_plan_marks_the_chosen_modules(capsys):
    assert main(["plan", "gpt2", "--segments", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for TinyGPT (levels, segments=3): recompute 4 modules\n  h.0\n")
    assert "\n*   h.3: Block" in out


def test_factory_file_target(tmp_path, capsys):
    file = tmp_path / "my_model.py"
    file.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build():
                model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
                return model, (torch.randn(2, 4),), {}

            def bad():
                return 42
            """
        )
    )
    assert main(["plan", f"{file}:build", "--segments", "0"]) == 0
    assert "recompute 1 module\n  (root)" in capsys.readouterr().out
    assert main(["plan", f"{file}:bad"]) == 2
    assert "must return (model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nope", "unknown target 'nope'"),
        ("missing.py:f", "no such file: missing.py"),
    ],
)
def test_bad_targets_give_one_line(target, message, capsys):
    assert main(["tree", target]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_bad_segments_is_one_line(capsys):
    assert main(["plan", "gpt2", "--segments", "-2"]) == 2
    assert (
        capsys.readouterr().err
        == "autoremat: error: segments must be >= 0, got -2; try segments=3\n"
    )


def test_python_dash_m_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "autoremat", "examples"], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[0].startswith("gpt2 ")
    assert "hf-llama" in done.stdout


def test_plan_objective_flag(capsys):
    assert main(["plan", "gpt2", "--budget", "50%", "--objective", "flops"]) == 0
    out = capsys.readouterr().out
    assert "minimised flops" in out and "selective" in out
    assert main(["plan", "gpt2", "--segments", "2", "--objective", "flops"]) == 2
    assert "--objective applies to budget plans" in capsys.readouterr().err
