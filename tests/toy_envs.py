"""Tiny envs for the tests, registered on import; a script reaches them as --env-id tests.toy_envs:NAME."""

import os
import time
from pathlib import Path

import gymnasium as gym
import numpy as np


class CounterEnv(gym.Env):
    """The observation is the step count t, so a stored next_obs of t+1 proves it is the true final one.

    Reward is 1 per step; the episode terminates at t == terminate_at (if set), and TimeLimit truncates it
    after max_episode_steps. The action space is deliberately asymmetric (or Discrete(3) with discrete=True,
    for sac_discrete). The reward becomes
    `bad_reward` from step `bad_from` on, counting the steps of all counter envs in the process (a script's
    global_step, give or take its evaluation episodes), to provoke a non-finite loss; likewise the observation
    becomes NaN from step `nan_obs_from` on (and the actions computed from it are then accepted unchecked).
    """

    steps_in_process = 0

    def __init__(
        self,
        terminate_at=None,
        bad_from=None,
        bad_reward=float("inf"),
        nan_obs_from=None,
        discrete=False,
        render_mode=None,
        step_seconds=0.0,
        action_space=None,
        make_seconds=0.0,
    ):
        if make_seconds:  # an env slow to make: a signal can come before the run has started
            Path("making_env").touch()
            time.sleep(make_seconds)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.action_space = action_space or (
            gym.spaces.Discrete(3)
            if discrete
            else gym.spaces.Box(np.array([0.0, -2.0], np.float32), np.array([1.0, 4.0], np.float32))
        )
        # Slow steps, in an env made after the process's 100th step (an evaluation's, not the training envs made at
        # the start): an evaluation long enough to be interrupted.
        slow = CounterEnv.steps_in_process >= 100 or os.environ.get("COUNTER_ENVS_SLOW")  # or every env, if asked
        self.step_seconds = step_seconds if slow else 0.0
        self.terminate_at, self.bad_from, self.bad_reward = terminate_at, bad_from, bad_reward
        self.nan_obs_from = nan_obs_from
        self.t = 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.t], np.float32), {}

    def step(self, action):
        if self.step_seconds:
            time.sleep(self.step_seconds)
            Path("slow_steps_began").touch()  # in the run's working directory: a test waits for it
        discrete = self.action_space.shape == ()
        if not self.nan_obs(CounterEnv.steps_in_process):
            assert self.action_space.contains(action if discrete else np.asarray(action, np.float32)), action
        self.t += 1
        CounterEnv.steps_in_process += 1
        reward = 1.0 if self.bad_from is None or CounterEnv.steps_in_process < self.bad_from else self.bad_reward
        obs = np.nan if self.nan_obs(CounterEnv.steps_in_process) else self.t
        return np.array([obs], np.float32), reward, self.t == self.terminate_at, False, {}

    def nan_obs(self, step):
        return self.nan_obs_from is not None and step >= self.nan_obs_from


for prefix, discrete in [("", False), ("Discrete", True)]:
    gym.register(f"{prefix}Counter-v0", CounterEnv, max_episode_steps=7, kwargs={"discrete": discrete})
    gym.register(
        f"{prefix}CounterTerminates-v0",
        CounterEnv,
        max_episode_steps=7,
        kwargs={"terminate_at": 4, "discrete": discrete},
    )
    gym.register(
        f"{prefix}CounterInfReward-v0", CounterEnv, max_episode_steps=7, kwargs={"bad_from": 300, "discrete": discrete}
    )
    gym.register(
        f"{prefix}CounterNanObs-v0", CounterEnv, max_episode_steps=7, kwargs={"nan_obs_from": 100, "discrete": discrete}
    )
    # No time limit: episodes end only by the env's own termination (never, here).
    gym.register(f"{prefix}CounterNoLimit-v0", CounterEnv, kwargs={"discrete": discrete})
    gym.register(
        f"{prefix}CounterSlow-v0",
        CounterEnv,
        max_episode_steps=1000,
        kwargs={"step_seconds": 0.005, "discrete": discrete},
    )
    gym.register(
        f"{prefix}CounterSlowToMake-v0",
        CounterEnv,
        max_episode_steps=7,
        kwargs={"make_seconds": 30.0, "discrete": discrete},
    )
# Spaces a script must refuse: actions of two dimensions, a Discrete space that does not start at 0.
gym.register(
    "CounterMatrixAction-v0",
    CounterEnv,
    max_episode_steps=7,
    kwargs={"action_space": gym.spaces.Box(-1.0, 1.0, (2, 2), np.float32)},
)
gym.register(
    "DiscreteCounterShifted-v0",
    CounterEnv,
    max_episode_steps=7,
    kwargs={"action_space": gym.spaces.Discrete(3, start=1), "discrete": True},
)
