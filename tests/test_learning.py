"""The learning tests: each algorithm reaches a stated evaluation return on a small task within a stated budget,
on CPU, with a fixed seed. They are the evidence that the algorithms work."""

import csv
from pathlib import Path

import pytest

from tests.conftest import run_main

# Each threshold sits at about half the worst measured seed and far above what an untrained, random or broken agent
# reaches; the measurements behind them (seeds, dates, what random and broken variants score) are in
# benchmark/results/learning_tests.md.
LEARNING = {
    # TD3, HalfCheetah-v4 (no alive bonus: a positive return needs a policy that runs), 30k steps (5k random).
    "td3_continuous": (["--env-id", "HalfCheetah-v4", "--total-timesteps", "30000"], 200.0),
    # TD7, the same task, 15k steps (5k random): out of reach of TD3-level sample efficiency too.
    "td7_continuous": (["--env-id", "HalfCheetah-v4", "--total-timesteps", "15000"], 800.0),
    # SAC, the same task, 20k steps (5k random).
    "sac_continuous": (["--env-id", "HalfCheetah-v4", "--total-timesteps", "20000"], 750.0),
    # Discrete SAC, CartPole-v1 (at most 500; random actions about 22), 15k steps (5k random).
    "sac_discrete": (["--env-id", "CartPole-v1", "--total-timesteps", "15000"], 150.0),
    # ERL-TD3, Pendulum-v1 (random policies about -1200 to -1600, a swing-up about -150 to -200), 22k steps (10
    # generations of 10 individuals and 1 learner), learner updates from 2k stored steps. The champion is chosen by
    # one noisy fitness episode, so its last evaluation swings: the test asserts on the learner's final and the
    # champion's best evaluation.
    "erl_td3": (
        ["--env-id", "Pendulum-v1", "--total-timesteps", "22000", "--learning-starts", "2000", "--eval-freq", "2200"],
        -400.0,
    ),
}
# 5k random steps, a fixed seed and one final deterministic evaluation over 10 episodes.
COMMON = [
    "--learning-starts",
    "5000",
    "--eval-freq",
    "0",
    "--eval-episodes",
    "10",
    "--checkpoint-freq",
    "0",
    "--no-cuda",
    "--seed",
    "1",
]


@pytest.mark.parametrize("script", LEARNING)
def test_learns(script, tmp_path, monkeypatch):
    flags, threshold = LEARNING[script]
    result = run_main(script, COMMON + flags, tmp_path, monkeypatch)  # a script's own flags come last and win
    print(f"{script} {flags[1]} after {flags[3]} steps: {result['eval_mean']:.1f} +- {result['eval_std']:.1f}")
    if script == "erl_td3":  # the learner at the end; the champion at its best (see above)
        with open(Path(result["run_dir"]) / "evaluations.csv") as f:
            champion = [float(row["mean_return"]) for row in csv.DictReader(f)]
        print(f"learner {result['learner_eval_mean']:.1f}; champion's evaluations {champion}")
        assert result["learner_eval_mean"] >= threshold
        assert max(champion) >= threshold
        assert champion[0] < threshold
    else:
        assert result["eval_mean"] >= threshold
