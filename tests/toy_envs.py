"""Tiny envs for the tests, registered on import; a script reaches them as --env-id tests.toy_envs:NAME."""
import gymnasium as gym
import numpy as np


class CounterEnv(gym.Env):
    """The observation is the step count t, so a stored next_obs of t+1 proves it is the true final one.

    Reward is 1 per step; the episode terminates at t == terminate_at (if set), and TimeLimit truncates it
    after max_episode_steps. The action space is deliberately asymmetric. The reward becomes
    `bad_reward` from global step `bad_from` on, to provoke a non-finite loss.
    """

    def __init__(self, terminate_at=None, bad_from=None, bad_reward=float("inf"), render_mode=None):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.action_space = gym.spaces.Box(np.array([0.0, -2.0], np.float32), np.array([1.0, 4.0], np.float32))
        self.terminate_at, self.bad_from, self.bad_reward = terminate_at, bad_from, bad_reward
        self.t, self.total_steps = 0, 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.t], np.float32), {}

    def step(self, action):
        assert self.action_space.contains(np.asarray(action, np.float32)), action
        self.t += 1
        self.total_steps += 1
        reward = 1.0 if self.bad_from is None or self.total_steps < self.bad_from else self.bad_reward
        return np.array([self.t], np.float32), reward, self.t == self.terminate_at, False, {}


gym.register("Counter-v0", CounterEnv, max_episode_steps=7)
gym.register("CounterTerminates-v0", CounterEnv, max_episode_steps=7, kwargs={"terminate_at": 4})
gym.register("CounterInfReward-v0", CounterEnv, max_episode_steps=7, kwargs={"bad_from": 300})
