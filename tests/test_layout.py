"""The layout every script shares (docs/layout.md): the algorithm on top, `main` short and flat,
the run machinery below one banner; and the one registry of what a checkpoint holds, which nothing escapes."""

import ast
import dataclasses
import importlib
import sys

import numpy as np
import pytest
import torch

from tests.conftest import REPO, SCRIPTS, TINY, flags_with, run_main

BANNER = "# Part 2: the run machinery. Nothing below changes what is computed"


def parsed(script):
    source = (REPO / f"{script}.py").read_text()
    return source, ast.parse(source)


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_is_short_and_flat(script):
    _, tree = parsed(script)
    (main,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    nested = [node.name for node in ast.walk(main) if isinstance(node, ast.FunctionDef) and node is not main]
    assert not nested, f"main defines {nested}: run machinery belongs below the banner, as top-level functions"
    assert main.end_lineno - main.lineno + 1 <= 125


@pytest.mark.parametrize("script", SCRIPTS)
def test_algorithm_above_one_banner_and_machinery_below(script):
    """One banner; above it the algorithm ending with main; below it the machinery main calls (class Run among it)."""
    source, tree = parsed(script)
    assert source.count(BANNER) == 1
    banner_line = source[: source.index(BANNER)].count("\n") + 1
    above = [node.name for node in tree.body if hasattr(node, "name") and node.lineno < banner_line]
    below = [node.name for node in tree.body if hasattr(node, "name") and node.lineno > banner_line]
    assert above[0] == "Args"
    assert above[-1] == "main"
    assert "Run" in below
    assert {"check_args", "check_env", "read_checkpoint", "evaluate"} <= set(below)
    assert all(len(line) <= 120 for line in source.splitlines())


def unregistered(local_vars, state):
    """The names of main's locals that hold training state but are not in the checkpoint's registry `state`."""
    registered = {id(value) for value in state.values()}

    def is_state(value):
        return (
            isinstance(value, (torch.nn.Module, torch.optim.Optimizer, np.random.Generator))
            or hasattr(value, "state_dict")
            and hasattr(value, "sample")  # replay buffers
            or isinstance(value, torch.Tensor)
            and value.requires_grad  # a learnt scalar such as log_alpha
            or dataclasses.is_dataclass(value)
            and type(value).__name__ != "Args"
        )  # TD7's CheckpointPolicy

    missing = []
    for name, value in local_vars.items():
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if is_state(item) and id(item) not in registered:
                missing.append(name if not isinstance(value, list) else f"{name}[{i}]")
    return missing


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_network_optimizer_and_buffer_is_in_the_checkpoint(script, tmp_path, monkeypatch):
    """At each checkpoint, every network, optimizer, replay buffer, RNG and learnt tensor that main holds is in the
    registry passed to save_checkpoint: one created without being registered would silently not be resumed."""
    module = importlib.import_module(script)
    save_checkpoint, seen = module.Run.save_checkpoint, []

    def checked(self, state, *rest, **loop):
        seen.append(unregistered(sys._getframe(1).f_locals, state))  # main's locals
        return save_checkpoint(self, state, *rest, **loop)

    monkeypatch.setattr(module.Run, "save_checkpoint", checked)
    run_main(script, flags_with(TINY, total_timesteps=300, eval_freq=0, checkpoint_freq=300), tmp_path, monkeypatch)
    assert seen, "save_checkpoint was never called"
    assert seen[-1] == [], f"not in the checkpoint: {seen[-1]}"
