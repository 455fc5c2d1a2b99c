"""TD7: TD3 + SALE embeddings + LAP replay + policy checkpoints (+ offline mode), in one file.

Paper: Fujimoto, Chang, Smith, Gu, Precup, Meger, "For SALE: State-Action Representation Learning for
Deep Reinforcement Learning", NeurIPS 2023, https://arxiv.org/abs/2306.02451. Defaults and the order of
every update are the authors' code (sfujim/TD7). Deliberate differences from it, none of which changes
the algorithm:
- gymnasium 1.x vector envs in same-step autoreset mode: a time-limit truncation keeps its bootstrap and
  stores the true final observation (the authors' `done = 0 at the time limit`, made exact).
- The replay buffer, its LAP priorities and the max-priority and value-clip bookkeeping live on the training
  device, so an update never waits for it (the authors read two maxima back to the host every update).
  Sampling is theirs: exact priority-proportional, a cumulative sum and a binary search.
- Networks that are never trained directly (targets, fixed encoders, checkpoints) hold no gradients, and the
  actor update computes none for the critic or the fixed encoder (the authors compute and discard them).
  Adam is the fused implementation (the same update rule). The names are CleanRL's, as in td3_continuous.py:
  the critic is `qf`, its optimizer `q_optimizer`, a training step an update (`num_updates`).
- With --no-checkpoints and --num-envs N, each vector step runs N training steps (one per env step).
- SIGINT/SIGTERM are acted on between training bursts, so after at most one episode's training steps.
- The LAP-Huber threshold follows --min-priority (the authors fix it at 1; the same at the default).
- Evaluation starts its --eval-episodes episodes from the same seeds every time (so every checkpoint policy is
  judged on the same start states; the authors' single evaluation env keeps advancing between evaluations).
- The critic's two heads are separate networks, as the authors' (not one batched module as in td3_continuous.py).
- --compile and --cudagraphs (both off by default; off computes exactly what it always did) run each update
  as a compiled callable or a replayed CUDA graph: README, "The GPU fast path".
- Added: periodic evaluation into evaluations.csv, checkpoints of the whole run with --resume, SIGINT/SIGTERM
  handling, a guard against non-finite losses, one-line errors for bad input, --save-buffer.

Offline mode (--offline --dataset PATH) trains on a fixed .npz dataset with the TD3+BC term and no policy
checkpoints, as the authors' D4RL mode; global_step then counts training steps. The file holds float arrays
observations (N, obs_dim), actions (N, act_dim) in the env's units, rewards (N,), next_observations
(N, obs_dim) and terminals (N,) (1 where the episode terminated; 0 otherwise, time-limit truncations too);
--save-buffer writes an online run's replay buffer in this format.

The file has two parts: the algorithm, from here to `main`, and below the banner after it the run
machinery, which changes nothing that is computed.
"""
import contextlib
import copy
import csv
import datetime
import io
import itertools
import json
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from functools import partial
from typing import Optional

import gymnasium as gym
import mujoco
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

# The -v4 MuJoCo envs are kept on purpose: the published results this project compares with use them.
warnings.filterwarnings("ignore", message=".*is out of date. You should consider upgrading.*")


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (python, numpy, torch and the envs)"""
    torch_deterministic: bool = True
    """on a GPU, deterministic algorithms wherever PyTorch has them (README, "Reproducibility on a GPU")"""
    cuda: bool = True
    """use the GPU if there is one"""
    torch_threads: int = 1
    """CPU threads for torch: 1 does not slow down when other work shares the cores (README, Threads); 0 keeps
    torch's default, one per core"""
    track: bool = False
    """log to Weights and Biases (set WANDB_MODE=offline to log without a network)"""
    wandb_project_name: str = "rl-baselines"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    capture_video: bool = False
    """record the first episode of every evaluation to videos/{run_name}"""
    save_model: bool = False
    """write the final networks to runs/{run_name}/model.pt"""
    env_id: str = "Hopper-v4"
    """the id of the environment"""
    total_timesteps: int = 1000000
    """total environment steps of the run"""
    num_envs: int = 1
    """parallel training environments (more than one needs --no-checkpoints)"""
    learning_starts: int = 25000
    """environment steps of uniformly random actions; training starts at the first episode end after them"""
    buffer_size: int = 1000000
    """the replay memory size"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    gamma: float = 0.99
    """the discount factor gamma"""
    eval_freq: int = 5000
    """deterministic evaluation every this many env steps (0: only the final evaluation)"""
    eval_episodes: int = 10
    """episodes per evaluation"""
    checkpoint_freq: int = 100000
    """write runs/{run_name}/checkpoint.pt every this many env steps and at the end (0: never)"""
    resume: Optional[str] = None
    """path of a checkpoint.pt to continue from (the run keeps its directory)"""
    log_freq: int = 100
    """log the mean of the losses over this many updates, and check them for NaN"""
    compile: bool = False
    """torch.compile the update steps (CPU or GPU; the same numbers up to float rounding)"""
    cudagraphs: bool = False
    """capture each update step once as a CUDA graph and replay it (needs a GPU; can be combined with --compile)"""

    # Algorithm specific arguments (the authors' defaults)
    offline: bool = False
    """train offline on --dataset, with the behaviour-cloning term and no policy checkpoints"""
    dataset: Optional[str] = None
    """an .npz dataset for --offline (format in the module docstring)"""
    save_buffer: bool = False
    """write the replay buffer to runs/{run_name}/buffer.npz at the end, in the --dataset format"""
    checkpoints: bool = True
    """TD7's policy checkpoints: train in bursts at episode ends, evaluate with the checkpoint policy"""
    target_update_rate: int = 250
    """updates (training steps) between the hard copies into the target and fixed networks"""
    exploration_noise: float = 0.1
    """the scale of the exploration noise (in the normalised action space [-1, 1])"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise"""
    noise_clip: float = 0.5
    """clip of the target policy smoothing noise"""
    policy_frequency: int = 2
    """the frequency of actor updates, in training steps"""
    alpha: float = 0.4
    """LAP: priorities are max(|td|, min_priority) ** alpha"""
    min_priority: float = 1.0
    """LAP: the floor of the priorities and the Huber threshold of the critic loss"""
    lmbda: float = 0.1
    """offline: weight of the behaviour-cloning term"""
    max_eps_when_checkpointing: int = 20
    """episodes that judge a policy after --steps-before-checkpointing (1 before)"""
    steps_before_checkpointing: int = 750000
    """updates after which checkpoints are judged on more episodes"""
    reset_weight: float = 0.9
    """the checkpoint's best minimum return is multiplied by this at that switch"""
    zs_dim: int = 256
    """the size of the SALE embeddings zs and zsa"""
    hidden_dim: int = 256
    """the hidden width of the encoder, critic and actor"""
    encoder_lr: float = 3e-4
    """the learning rate of the encoder"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 3e-4
    """the learning rate of the Q network optimizer"""


def make_env(env_id):
    return lambda: gym.make(env_id)


def to_env(action, low, high):
    """The one place where a normalised action in [-1, 1] becomes the env's action in [low, high]."""
    return low + (action + 1.0) * 0.5 * (high - low)


def AvgL1Norm(x, eps=1e-8):
    """x / max(mean(|x|) over the last dimension, eps): keeps an embedding's scale fixed."""
    return x / x.abs().mean(-1, keepdim=True).clamp(min=eps)


def LAP_huber(td, min_priority=1.0):
    """The LAP critic loss: 0.5 td^2 below min_priority, min_priority * td above; summed over heads, batch mean."""
    return torch.where(td < min_priority, 0.5 * td.pow(2), min_priority * td).sum(1).mean()


class Encoder(nn.Module):
    """SALE: the state encoder f(s) -> zs (AvgL1Norm'd) and the state-action encoder g(zs, a) -> zsa; ELU."""

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.zs_net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                                    nn.Linear(hidden, zs_dim))
        self.zsa_net = nn.Sequential(nn.Linear(zs_dim + act_dim, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                                     nn.Linear(hidden, zs_dim))

    def zs(self, obs):
        return AvgL1Norm(self.zs_net(obs))

    def zsa(self, zs, action):
        return self.zsa_net(torch.cat([zs, action], 1))


class Actor(nn.Module):
    """pi(s, zs): a0 = AvgL1Norm(Linear(s)), then [a0, zs] through a 256-256 ReLU MLP with a tanh output in [-1, 1]."""

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.l0 = nn.Linear(obs_dim, hidden)
        self.net = nn.Sequential(nn.Linear(zs_dim + hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, act_dim), nn.Tanh())

    def forward(self, obs, zs):
        return self.net(torch.cat([AvgL1Norm(self.l0(obs)), zs], 1))


class Critic(nn.Module):
    """Two heads Q_i(s, a, zsa, zs): q0 = AvgL1Norm(Linear([s, a])), then [q0, zsa, zs] through a 256-256 ELU MLP.

    forward returns Q values of shape (batch, 2).
    """

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.q0 = nn.ModuleList(nn.Linear(obs_dim + act_dim, hidden) for _ in range(2))
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * zs_dim + hidden, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                          nn.Linear(hidden, 1)) for _ in range(2))

    def forward(self, obs, action, zsa, zs):
        sa, embeddings = torch.cat([obs, action], 1), torch.cat([zsa, zs], 1)
        q = [head(torch.cat([AvgL1Norm(q0(sa)), embeddings], 1)) for q0, head in zip(self.q0, self.heads)]
        return torch.cat(q, 1)

    def fixed(self, obs, action, zsa, zs):
        """Q values with the critic's weights held fixed: gradients reach the action and zsa, not the critic."""
        params = {name: p.detach() for name, p in self.named_parameters()}
        return torch.func.functional_call(self, params, (obs, action, zsa, zs))


class LAPReplayBuffer:
    """LAP replay in one preallocated float32 tensor on the training device, with a priority per row.

    A row is [obs, action, reward, terminated, next_obs], actions normalised to [-1, 1], written by slice from one
    asynchronous upload per vector step. New rows get the current max priority; a batch is drawn with probability
    proportional to priority (exactly: a cumulative sum and a binary search, as the authors' code), into
    `self.batch`, which stays in one place in memory (as a CUDA graph needs); there are no importance weights. The
    length is a device tensor too, so that sampling never reads a host number.
    """

    def __init__(self, capacity, obs_dim, act_dim, batch_size, device):
        self.capacity = capacity
        self.device = device
        self.pos = 0
        self.full = False
        self.split = [obs_dim, act_dim, 1, 1, obs_dim]
        self.data = torch.zeros(capacity, sum(self.split), device=device)
        self.batch = torch.zeros(batch_size, sum(self.split), device=device)
        self.priority = torch.zeros(capacity, device=device)
        self.max_priority = torch.ones((), device=device)
        self.idx = torch.zeros(batch_size, dtype=torch.int64, device=device)  # the last batch's rows
        self.length = torch.zeros((), dtype=torch.int64, device=device)
        # On a GPU a float cumsum is not deterministic: with --torch-deterministic, sum integers instead.
        self.exact = torch.device(device).type == "cuda" and torch.are_deterministic_algorithms_enabled()

    def __len__(self):
        return self.capacity if self.full else self.pos

    def add(self, obs, action, reward, terminated, next_obs):
        """Store one row per env (or a whole dataset), at the current max priority."""
        rows = upload(np.concatenate([obs, action, reward[:, None], terminated[:, None], next_obs], 1), self.device)
        first = min(len(rows), self.capacity - self.pos)  # the rows before the ring wraps around
        self.data[self.pos : self.pos + first] = rows[:first]
        self.data[: len(rows) - first] = rows[first:]
        self.priority[self.pos : self.pos + first] = self.max_priority
        self.priority[: len(rows) - first] = self.max_priority
        self.full = self.full or self.pos + len(rows) >= self.capacity
        self.pos = (self.pos + len(rows)) % self.capacity
        self.length.fill_(len(self))

    def sample(self):
        """obs, action, reward, terminated, next_obs; reward and terminated of shape (batch, 1)."""
        # Over the whole ring, whose unwritten rows have priority 0: the length stays on the device.
        if self.exact:  # a sum of integers (priorities in units of 2**-20) is exact: the same on every GPU run
            csum = torch.cumsum((self.priority.double() * 2**20).round().long(), 0)
            value = (torch.rand(len(self.batch), dtype=torch.float64, device=self.device) * csum[-1]).long()
            self.idx.copy_(torch.searchsorted(csum, value, right=True).clamp(max=self.length - 1))
        else:
            csum = torch.cumsum(self.priority, 0)
            value = torch.rand(len(self.batch), device=self.device) * csum[-1]
            self.idx.copy_(torch.searchsorted(csum, value).clamp(max=self.length - 1))
        self.batch.copy_(self.data[self.idx])
        return self.batch.split(self.split, dim=1)

    def update_priority(self, priority):
        self.priority[self.idx] = priority
        self.max_priority.copy_(torch.maximum(self.max_priority, priority.max()))

    def reset_max_priority(self):
        self.max_priority.copy_(self.priority[: len(self)].max())

    def state_dict(self):
        return {"data": self.data[: len(self)].to("cpu", copy=True), "pos": self.pos, "full": self.full,
                "priority": self.priority[: len(self)].to("cpu", copy=True), "max_priority": self.max_priority.cpu()}

    def load_state_dict(self, state):
        self.data[: len(state["data"])] = state["data"].to(self.device)
        self.priority[: len(state["priority"])] = state["priority"].to(self.device)
        self.pos = state["pos"]
        self.full = state["full"]
        self.max_priority.copy_(state["max_priority"])
        self.length.fill_(len(self))


def upload(array, device):
    """A host array as a float32 tensor on `device`, without waiting for a GPU: copied from pinned memory,
    asynchronously (later work on the device is ordered after the copy)."""
    tensor = torch.as_tensor(array, dtype=torch.float32)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


def td_target(reward, terminated, next_q, gamma):
    """y = r + gamma * (1 - terminated) * min_i Q'_i(s', a'): only a true termination stops the bootstrap."""
    return reward + gamma * (1.0 - terminated) * next_q


def frozen_copy(network):
    """A copy that is only ever overwritten, never trained: it holds no gradients."""
    return copy.deepcopy(network).requires_grad_(False)


def update_encoder(batch, encoder, encoder_optimizer):
    """SALE: g(f(s), a) predicts f(s'), both from the current encoder."""
    obs, action, _, _, next_obs = batch
    with torch.no_grad():
        next_zs = encoder.zs(next_obs)
    encoder_loss = F.mse_loss(encoder.zsa(encoder.zs(obs), action), next_zs)
    encoder_optimizer.zero_grad(set_to_none=True)
    encoder_loss.backward()
    encoder_optimizer.step()
    return encoder_loss.detach()


def update_critic(batch, actor_target, qf, qf_target, q_optimizer, fixed_encoder, fixed_encoder_target, value_range,
                  value_clip, args):
    """Clipped double-Q target through the fixed target encoder, clipped to the range of the targets seen up to the
    last target update (value_range keeps it); LAP-Huber loss. Returns the loss, the TD errors (batch, 2), the mean
    Q values and the fixed embedding zs of the batch, which the actor update reuses."""
    obs, action, reward, terminated, next_obs = batch
    with torch.no_grad():
        fixed_target_zs = fixed_encoder_target.zs(next_obs)
        noise = (torch.randn_like(action) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
        next_action = (actor_target(next_obs, fixed_target_zs) + noise).clamp(-1.0, 1.0)
        fixed_target_zsa = fixed_encoder_target.zsa(fixed_target_zs, next_action)
        next_q = qf_target(next_obs, next_action, fixed_target_zsa, fixed_target_zs).min(1, keepdim=True)[0]
        target = td_target(reward, terminated, next_q.clamp(value_clip[0], value_clip[1]), args.gamma)
        value_range.copy_(torch.stack((torch.minimum(value_range[0], target.min()),
                                       torch.maximum(value_range[1], target.max()))))
        fixed_zs = fixed_encoder.zs(obs)
        fixed_zsa = fixed_encoder.zsa(fixed_zs, action)
    q = qf(obs, action, fixed_zsa, fixed_zs)
    td = (q - target).abs()
    qf_loss = LAP_huber(td, args.min_priority)
    q_optimizer.zero_grad(set_to_none=True)
    qf_loss.backward()
    q_optimizer.step()
    return qf_loss.detach(), td.detach(), q.detach().mean(0), fixed_zs


def update_actor(batch, fixed_zs, actor, qf, fixed_encoder, actor_optimizer, args):
    """-Q(s, pi(s)) through the fixed encoder, plus the TD3+BC term offline; gradients reach the actor only."""
    obs, action = batch[0], batch[1]
    pi = actor(obs, fixed_zs)
    q_pi = qf.fixed(obs, pi, fixed_encoder.zsa(fixed_zs, pi), fixed_zs)
    actor_loss = -q_pi.mean()
    if args.offline:  # TD3+BC
        actor_loss = actor_loss + args.lmbda * q_pi.abs().mean().detach() * F.mse_loss(pi, action)
    actor_optimizer.zero_grad(set_to_none=True)
    actor_loss.backward()
    actor_optimizer.step()
    return actor_loss.detach()


def update(rb, encoder, actor, qf, fixed_encoder, fixed_encoder_target, actor_target, qf_target, value_range,
           value_clip, encoder_optimizer, q_optimizer, actor_optimizer, args, with_actor):
    """One update on a new batch: the encoder, the critic, the batch's LAP priorities, and with_actor the actor.
    Returns its losses and the critic's mean Q values by name."""
    batch = rb.sample()
    encoder_loss = update_encoder(batch, encoder, encoder_optimizer)
    qf_loss, td, qf_values, fixed_zs = update_critic(batch, actor_target, qf, qf_target, q_optimizer, fixed_encoder,
                                                     fixed_encoder_target, value_range, value_clip, args)
    rb.update_priority(td.max(1)[0].clamp(min=args.min_priority).pow(args.alpha))  # LAP
    metrics = {"qf_loss": qf_loss, "encoder_loss": encoder_loss, "qf1_values": qf_values[0], "qf2_values": qf_values[1]}
    if with_actor:
        metrics["actor_loss"] = update_actor(batch, fixed_zs, actor, qf, fixed_encoder, actor_optimizer, args)
    return metrics


@dataclass
class CheckpointPolicy:
    """TD7's policy checkpoints as a state machine over episode ends (the authors' maybe_train_and_checkpoint).

    A policy is judged on the minimum return of its episodes: 1 episode at first, max_eps_when_checkpointing
    after steps_before_checkpointing training steps. It becomes the checkpoint if it does at least as well as
    the checkpoint did; as soon as one episode does worse, judging stops early. Either way, the agent then
    trains for as many updates as the judged episodes took steps.
    """
    max_eps_before_update: int = 1
    eps_since_update: int = 0
    timesteps_since_update: int = 0
    min_return: float = 1e8
    best_min_return: float = -1e8

    def episode_end(self, length, episode_return):
        """Returns (take_checkpoint, updates to run now)."""
        self.eps_since_update += 1
        self.timesteps_since_update += length
        self.min_return = min(self.min_return, episode_return)
        if self.min_return < self.best_min_return:  # worse than the checkpoint: stop judging early
            return False, self.reset()
        if self.eps_since_update == self.max_eps_before_update:
            self.best_min_return = self.min_return
            return True, self.reset()
        return False, 0

    def reset(self):
        updates = self.timesteps_since_update
        self.eps_since_update, self.timesteps_since_update, self.min_return = 0, 0, 1e8
        return updates

    def before_update(self, num_updates, args):
        """After steps_before_checkpointing updates: judge on more episodes, and lower the bar by reset_weight."""
        if num_updates == args.steps_before_checkpointing:
            self.best_min_return *= args.reset_weight
            self.max_eps_before_update = args.max_eps_when_checkpointing


def true_next_obs(next_obs, infos):
    """Same-step autoreset: next_obs of a finished env is already the next episode's first observation; the
    transition must store the true final one."""
    real_next_obs = next_obs.copy()
    for i in np.flatnonzero(infos.get("_final_obs", [])):
        real_next_obs[i] = infos["final_obs"][i]
    return real_next_obs


def main(args):
    check_env(args.env_id)
    check_args(args)
    checkpoint = read_checkpoint(args)
    envs = gym.vector.SyncVectorEnv([make_env(args.env_id) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    dataset = load_dataset(args.dataset, obs_dim, act_dim, low, high) if args.offline else None
    device = choose_device(args)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)  # the random actions before learning starts

    encoder = Encoder(obs_dim, act_dim, args.zs_dim, args.hidden_dim).to(device)
    actor = Actor(obs_dim, act_dim, args.zs_dim, args.hidden_dim).to(device)
    qf = Critic(obs_dim, act_dim, args.zs_dim, args.hidden_dim).to(device)
    fixed_encoder, fixed_encoder_target, checkpoint_encoder = (frozen_copy(encoder) for _ in range(3))
    actor_target, checkpoint_actor = frozen_copy(actor), frozen_copy(actor)
    qf_target = frozen_copy(qf)
    # Value clipping: targets are clipped to the (min, max) of all targets seen up to the last target update.
    value_range, value_clip = torch.tensor([1e8, -1e8], device=device), torch.zeros(2, device=device)
    # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
    encoder_optimizer = torch.optim.Adam(encoder.parameters(), lr=args.encoder_lr, fused=True,
                                         capturable=args.cudagraphs)
    q_optimizer = torch.optim.Adam(qf.parameters(), lr=args.q_lr, fused=True, capturable=args.cudagraphs)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr, fused=True, capturable=args.cudagraphs)
    capacity = len(dataset["observations"]) if args.offline else args.buffer_size
    check_memory(LAPReplayBuffer(capacity, obs_dim, act_dim, args.batch_size, torch.device("meta")), device)
    rb = LAPReplayBuffer(capacity, obs_dim, act_dim, args.batch_size, device)
    # The updates (without and with the delayed actor step) as callables, compiled or CUDA graphs under the flags.
    update_steps = [accelerate(partial(update, rb, encoder, actor, qf, fixed_encoder, fixed_encoder_target,
                                       actor_target, qf_target, value_range, value_clip, encoder_optimizer,
                                       q_optimizer, actor_optimizer, args, with_actor), args)
                    for with_actor in (False, True)]
    if args.offline and not checkpoint:
        rb.add(*(dataset[key] for key in ("observations", "actions", "rewards", "terminals", "next_observations")))
    policy, use_checkpoints = CheckpointPolicy(), args.checkpoints and not args.offline  # TD7's, online only
    # Everything a checkpoint holds besides the loop's counters and the envs: --resume restores exactly these.
    state = {"encoder": encoder, "actor": actor, "qf": qf, "fixed_encoder": fixed_encoder,
             "fixed_encoder_target": fixed_encoder_target, "checkpoint_encoder": checkpoint_encoder,
             "actor_target": actor_target, "checkpoint_actor": checkpoint_actor, "qf_target": qf_target,
             "value_range": value_range, "value_clip": value_clip, "encoder_optimizer": encoder_optimizer,
             "q_optimizer": q_optimizer, "actor_optimizer": actor_optimizer, "rb": rb, "policy": policy, "rng": rng}
    # Evaluation and the saved model use the checkpoint policy when there is one.
    eval_actor, eval_encoder = (checkpoint_actor, checkpoint_encoder) if use_checkpoints else (actor, fixed_encoder)
    run = Run(args, checkpoint, device)

    obs, _ = envs.reset(seed=args.seed)
    obs_on_device = upload(obs, device)
    episode_return, episode_length = np.zeros(args.num_envs), np.zeros(args.num_envs, dtype=np.int64)
    global_step, num_updates, allow_train = 0, 0, args.offline
    if checkpoint:
        (global_step, num_updates, allow_train), episodes = run.restore(checkpoint, state, envs.envs)
        obs, episode_return, episode_length = episodes or (obs, episode_return, episode_length)
        obs_on_device = upload(obs, device)
    metrics = {"actor_loss": torch.zeros((), device=device)}  # the last of each, as the actor's is delayed
    try:
        while global_step < args.total_timesteps:
            if args.offline:  # one update per step, on the dataset
                global_step, num_new_updates = global_step + 1, 1
            else:
                if not allow_train:
                    action = rng.uniform(-1.0, 1.0, (args.num_envs, act_dim))
                else:
                    with torch.no_grad():
                        action = actor(obs_on_device, fixed_encoder.zs(obs_on_device))
                        action = (action + torch.randn_like(action) * args.exploration_noise).clamp(-1.0, 1.0)
                        action = action.cpu().numpy()
                    run.check_finite(global_step, action=action)  # the action is on the host anyway: a free check
                next_obs, reward, terminated, truncated, infos = envs.step(to_env(action, low, high))
                global_step += args.num_envs
                run.check_finite(global_step, observation=next_obs)

                # With policy checkpoints the agent trains in bursts at episode ends; without, one update per step.
                num_new_updates = args.num_envs if allow_train and not use_checkpoints else 0
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(terminated | truncated):
                    run.log_episode(global_step, episode_return[i], episode_length[i])
                    if allow_train and use_checkpoints:
                        take_checkpoint, updates = policy.episode_end(int(episode_length[i]), float(episode_return[i]))
                        if take_checkpoint:
                            checkpoint_actor.load_state_dict(actor.state_dict())
                            checkpoint_encoder.load_state_dict(fixed_encoder.state_dict())
                        num_new_updates += updates
                    allow_train = allow_train or global_step > args.learning_starts
                    episode_return[i], episode_length[i] = 0.0, 0

                rb.add(obs, action, reward, terminated, true_next_obs(next_obs, infos))
                obs = next_obs
                obs_on_device = upload(obs, device)

            for _ in range(num_new_updates):
                if use_checkpoints:
                    policy.before_update(num_updates, args)
                num_updates += 1
                metrics.update(update_steps[num_updates % args.policy_frequency == 0]())
                if num_updates % args.target_update_rate == 0:  # the cascade: each target takes what it follows
                    actor_target.load_state_dict(actor.state_dict())
                    qf_target.load_state_dict(qf.state_dict())
                    fixed_encoder_target.load_state_dict(fixed_encoder.state_dict())  # the old fixed encoder
                    fixed_encoder.load_state_dict(encoder.state_dict())
                    rb.reset_max_priority()
                    value_clip.copy_(value_range)
                run.record(global_step, num_updates, **metrics)

            run.progress(global_step, num_updates)
            done = global_step >= args.total_timesteps
            if crossed(global_step, args.eval_freq, args.num_envs) or done:
                run.evaluate(global_step, lambda o: eval_actor(o, eval_encoder.zs(o)))
            if crossed(global_step, args.checkpoint_freq, args.num_envs) or (done and args.checkpoint_freq) or run.stop:
                run.save_checkpoint(state, (global_step, num_updates, allow_train), envs.envs,
                                    (obs, episode_return, episode_length))
        if args.save_model:
            run.save_model(actor=eval_actor, encoder=eval_encoder, qf=qf)
        if args.save_buffer:
            run.save_buffer(rb, low, high)
    finally:
        envs.close()
        run.close()
    return run.result


# ======================================================================================================================
# Part 2: the run machinery. Nothing below changes what is computed: it checks the input, owns the run's directory
# (args.json, TensorBoard, evaluations.csv, checkpoints, the model), evaluates, stops on non-finite numbers and
# turns SIGINT/SIGTERM into a checkpoint.
# ======================================================================================================================

# Flags that may differ when resuming: they change how a run is watched, not what it computes.
RESUMABLE_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video",
                   "save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda",
                   "save_buffer"}
# Flags of online training that --offline would ignore: it refuses them instead.
OFFLINE_IGNORES = ["buffer_size", "learning_starts", "exploration_noise", "num_envs", "checkpoints",
                   "max_eps_when_checkpointing", "steps_before_checkpointing", "reset_weight"]


def fail(message):
    """Stop with one line on stderr and exit status 1: the form of every user error."""
    sys.exit(f"error: {message}")


def first_line(error):
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def parse_args(argv=None):
    """tyro's parser, with its error box shortened to one line in tyro's words: the message (which names the flag)
    and, for a misspelled flag, the one it resembles."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        return tyro.cli(Args, args=argv)
    message, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "1000"  # tyro wraps its box at the terminal's width: one message, one row
    try:
        with contextlib.redirect_stderr(message):
            return tyro.cli(Args, args=argv)
    except SystemExit:
        rows = [row.strip("│ ").strip() for row in message.getvalue().splitlines() if row.startswith("│")]
        rows = [row for row in rows if row and not row.startswith(("─", "For full helptext"))]
        meant = rows[rows.index("Perhaps you meant:") + 1:] if "Perhaps you meant:" in rows else []
        hint = next((row for row in meant if row.startswith("--")), None)
        print(f"error: {rows[0] if rows else 'cannot parse the command line'}"
              + (f" (perhaps you meant {hint})" if hint else ""), file=sys.stderr)
        sys.exit(2)
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def check_args(args):
    """Every numeric flag finite and in its range, before anything is written."""
    positive = ["total_timesteps", "num_envs", "buffer_size", "batch_size", "eval_episodes", "log_freq",
                "policy_frequency", "target_update_rate", "encoder_lr", "q_lr", "policy_lr", "zs_dim", "hidden_dim",
                "max_eps_when_checkpointing", "min_priority", "reset_weight"]
    non_negative = ["learning_starts", "eval_freq", "checkpoint_freq", "torch_threads", "policy_noise", "noise_clip",
                    "exploration_noise", "alpha", "lmbda", "steps_before_checkpointing"]
    unit_interval = ["gamma", "reset_weight"]
    for name, value in asdict(args).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, float) and not np.isfinite(value):
            fail(f"{flag} must be a finite number, got {value}")
        if name in positive and value <= 0 or name in non_negative and value < 0:
            fail(f"{flag} must be {'positive' if name in positive else 'non-negative'}, got {value}")
        if name in unit_interval and not 0 <= value <= 1:
            fail(f"{flag} must lie in [0, 1], got {value}")
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}")
    if args.cudagraphs and not (args.cuda and torch.cuda.is_available()):
        fail("--cudagraphs needs a GPU: " + ("--no-cuda is set" if not args.cuda else "none is available"))
    if args.learning_starts >= args.total_timesteps and not args.offline:
        fail(f"--learning-starts {args.learning_starts} is not below --total-timesteps {args.total_timesteps}: no "
             "update would ever happen")
    if args.offline != bool(args.dataset):
        fail("--offline needs --dataset PATH" if args.offline else "--dataset is only read with --offline")
    for name in OFFLINE_IGNORES if args.offline else []:
        value = getattr(args, name)
        if value != getattr(Args, name):
            fail(f"--{'no-' if value is False else ''}{name.replace('_', '-')} has no effect with --offline: it trains "
                 "on the whole dataset, one update per step, without policy checkpoints")
    if args.num_envs > 1 and args.checkpoints and not args.offline:
        fail("--num-envs above 1 needs --no-checkpoints: a checkpoint judges whole episodes of one policy")


def check_env(env_id):
    """Fail with one line unless env_id names an env this script can learn: vector observations, bounded actions."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises many kinds: unknown id, missing extra, bad module path
        fail(f"cannot make --env-id {env_id!r}: {first_line(e)}")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Box):
        fail(f"{env_id} has a {type(act_space).__name__} action space; TD7 needs a continuous (Box) one, "
             "see sac_discrete.py")
    if not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        fail(f"{env_id} has unbounded actions; TD7's tanh policy needs finite bounds")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        fail(f"{env_id} has {obs_space} observations; this script needs a flat vector (Box of one dimension)")


DATASET_KEYS = ("observations", "actions", "rewards", "next_observations", "terminals")


def load_dataset(path, obs_dim, act_dim, low, high):
    """The --dataset arrays (format in the module docstring), actions normalised to [-1, 1]; fails with one line."""
    try:
        with np.load(path) as data:
            d = {key: np.asarray(data[key], dtype=np.float64) for key in DATASET_KEYS}
    except Exception as e:
        fail(f"cannot read --dataset {path}: {first_line(e)}")
    n = len(d["observations"])
    if n == 0:
        fail(f"--dataset {path} holds no transitions")
    expected = {"observations": (n, obs_dim), "actions": (n, act_dim), "rewards": (n,),
                "next_observations": (n, obs_dim), "terminals": (n,)}
    for key, shape in expected.items():
        if d[key].shape != shape:
            fail(f"--dataset {path}: {key} has shape {d[key].shape}, the env needs {shape}")
        if not np.isfinite(d[key]).all():
            fail(f"--dataset {path}: {key} holds a non-finite value, in row {np.flatnonzero(~np.isfinite(d[key]))[0]}")
    d["actions"] = np.clip(2.0 * (d["actions"] - low) / (high - low) - 1.0, -1.0, 1.0)
    return d


def read_checkpoint(args):
    """The --resume checkpoint (None without one), refused unless it was made with the same algorithm flags."""
    if not args.resume:
        return None
    try:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
    except Exception as e:
        fail(f"cannot read --resume file {args.resume}: {first_line(e)}")
    if not isinstance(checkpoint, dict) or not {"args", "run_name", "global_step", "state"} <= checkpoint.keys():
        fail(f"--resume file {args.resume} is not a checkpoint.pt of this script (model.pt holds only the networks)")
    saved_args, step = checkpoint["args"], checkpoint["global_step"]
    for name, value in asdict(args).items():
        if name not in RESUMABLE_FLAGS and saved_args.get(name) != value:
            fail(f"--resume file {args.resume} was made with --{name.replace('_', '-')} {saved_args.get(name)}, "
                 f"not {value}")
    if args.total_timesteps <= step:
        fail(f"--total-timesteps {args.total_timesteps} is not beyond the checkpoint's global_step {step}")
    return checkpoint


def choose_device(args):
    """The training device (a warning line when --cuda finds no GPU); sets torch's CPU threads."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.cuda and not torch.cuda.is_available():
        print("warning: --cuda is set but no GPU is available; running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and args.torch_deterministic:  # the CPU's ops are deterministic already
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition, before its first use
        torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any op that has no such version
    return device


def accelerate(step, args):
    """An update step (a callable without arguments) as it runs: as it is, torch.compile'd (--compile), and/or
    captured as one CUDA graph (--cudagraphs)."""
    step = torch.compile(step) if args.compile else step
    return CudaGraph(step) if args.cudagraphs else step


class CudaGraph:
    """--cudagraphs: `step` runs eagerly for `warmup` calls on a side stream (optimizer state, compilation), is then
    captured once and replayed: one launch per update instead of one per kernel. It may only read and write tensors
    that stay in place (in-place state, the buffer's `batch` and `length`), and it returns the same output tensors,
    overwritten, at every replay."""

    def __init__(self, step, warmup=3):
        self.step, self.warmup, self.graph, self.outputs = step, warmup, None, None

    def __call__(self):
        if self.warmup:
            self.warmup -= 1
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outputs = self.step()
            torch.cuda.current_stream().wait_stream(stream)
            return outputs
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.step()
        self.graph.replay()
        return self.outputs


def crossed(step, freq, step_size):
    """True when the last step_size steps, ending at step, crossed a multiple of freq (never when freq is 0)."""
    return freq > 0 and step // freq != (step - step_size) // freq


def env_state(env):
    """What it takes to continue one env's episode bit for bit: its RNG, time-limit counter and physics."""
    u = env.unwrapped
    state = {"np_random": u.np_random.bit_generator.state, "elapsed_steps": env.get_wrapper_attr("_elapsed_steps")}
    if hasattr(u, "model") and hasattr(u, "data"):  # MuJoCo: the full integration state, warm-start included
        state["mujoco"] = np.empty(mujoco.mj_stateSize(u.model, mujoco.mjtState.mjSTATE_INTEGRATION))
        mujoco.mj_getState(u.model, u.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
    elif hasattr(u, "state"):  # classic control
        state["state"] = np.array(u.state)
    return state


def set_env_state(env, state):
    u = env.unwrapped
    u.np_random.bit_generator.state = state["np_random"]
    env.set_wrapper_attr("_elapsed_steps", state["elapsed_steps"])
    if "mujoco" in state:
        mujoco.mj_setState(u.model, u.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_forward(u.model, u.data)
    else:
        u.state = state["state"]


def evaluate(policy, env_id, episodes, seed, device, video_folder=None, video_prefix="eval"):
    """Returns of `episodes` full episodes of the deterministic `policy` (no noise), on a separate env."""
    if video_folder:
        env = gym.wrappers.RecordVideo(gym.make(env_id, render_mode="rgb_array"), video_folder,
                                       episode_trigger=lambda e: e == 0, name_prefix=video_prefix)
    else:
        env = gym.make(env_id)
    low, high = env.action_space.low, env.action_space.high
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, episode_return = False, 0.0
        while not done:
            with torch.no_grad():
                action = policy(upload(obs[None], device))[0].cpu().numpy()  # the one wait per step
            obs, reward, terminated, truncated, _ = env.step(to_env(action, low, high))
            episode_return += float(reward)
            done = terminated or truncated
        returns.append(episode_return)
    env.close()
    return returns


def drop_evaluations_after(path, global_step):
    """On resume, forget evaluations made after the checkpoint (the resumed run makes them again), rewriting the file
    through a temp file; a malformed file is refused and left as it is. Returns the last evaluation kept, as the
    progress line shows it."""
    if not os.path.exists(path):
        return "-"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    try:
        kept = rows[:1] + [row for row in rows[1:] if int(row[0]) <= global_step]
        last = f"{float(kept[-1][2]):.1f} +- {float(kept[-1][3]):.1f}" if len(kept) > 1 else "-"
    except (ValueError, IndexError):
        fail(f"cannot resume: {path} has a malformed row; mend or remove it")
    write_atomically(path, lambda f: csv.writer(f).writerows(kept))
    return last


def write_atomically(path, write):
    """Write a text file through a temp file and a rename: a kill while writing leaves the old file whole."""
    with open(path + ".tmp", "w", newline="") as f:
        write(f)
    os.replace(path + ".tmp", path)


def claim_run_dir(name):
    """Create runs/{name} exclusively, or runs/{name}-1, -2 ... when another run took it in the same second: a run
    owns its directory. Returns the name taken and the directory."""
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as e:
        fail(f"cannot create the run directory in {os.path.abspath('runs')}: {e.strerror}")
    for i in itertools.count():
        candidate = name if i == 0 else f"{name}-{i}"
        try:
            os.mkdir(os.path.join("runs", candidate))
            return candidate, os.path.abspath(os.path.join("runs", candidate))
        except FileExistsError:
            continue


def check_memory(buffer, device):
    """Fail with one line unless the replay `buffer`, built on the meta device (shapes and dtypes, no memory), fits
    in the memory `device` has free: the GPU's, or the host's (MemAvailable, within a cgroup's limit)."""
    tensors = [t for v in vars(buffer).values() for t in (v.values() if isinstance(v, dict) else [v])]
    need = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # free pages, without reclaimable cache
        with contextlib.suppress(OSError, IndexError):
            free = int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024
        with contextlib.suppress(OSError, ValueError):
            limit = open("/sys/fs/cgroup/memory.max").read().strip()
            free = min(free, int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    if need > free:
        fail(f"the replay buffer needs {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free on the "
             f"{device.type}; lower --buffer-size")


class Run:
    """One run's directory and logs, its evaluations and checkpoints, SIGINT/SIGTERM and the non-finite guard."""

    def __init__(self, args, checkpoint, device):
        self.args, self.device, self.start_time, self.wall_time = args, device, time.time(), 0.0
        self.eval_text = "-"  # the last evaluation, as the progress line shows it
        if checkpoint:
            self.name, self.dir = checkpoint["run_name"], os.path.dirname(os.path.abspath(args.resume))
            self.eval_text = drop_evaluations_after(os.path.join(self.dir, "evaluations.csv"),
                                                    checkpoint["global_step"])
        else:
            env_name = args.env_id.replace("/", "-").replace(":", "-")
            self.name, self.dir = claim_run_dir(f"{env_name}__{args.exp_name}__{args.seed}__{int(time.time())}")
        self.checkpoint_path = os.path.join(self.dir, "checkpoint.pt")
        write_atomically(os.path.join(self.dir, "args.json"), lambda f: json.dump(asdict(args), f, indent=2))
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=asdict(args), name=self.name, id=self.name[-64:].replace(".", "-"), resume="allow",
                       save_code=True, dir=self.dir)
        if args.capture_video and "DISPLAY" not in os.environ:
            os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering
        self.writer = SummaryWriter(self.dir, purge_step=checkpoint["global_step"] if checkpoint else None)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in asdict(args).items()))
        # Each update's metrics stay on the device until the next log, so that a non-finite one can be named with
        # its update and step without waiting for the device after every update.
        self.names, self.history, self.updates, self.sps_start = None, [], [], None
        self.tty, self.reported, self.pending = sys.stdout.isatty(), False, False
        self.last_report = (time.time(), *(checkpoint["counters"][:2] if checkpoint else (0, 0)))  # time, step, updates
        self.stop = []  # the signal that asks the run to stop, once one arrives
        self.handlers = {s: signal.signal(s, lambda signum, frame: self.stop.append(signum))
                         for s in (signal.SIGINT, signal.SIGTERM)}
        print(f"run {self.dir}: {args.env_id}, {args.total_timesteps} steps on {device}", flush=True)

    def sps(self, global_step):
        """Env steps per second since the first update."""
        start_step, start_time = self.sps_start or (global_step, time.time())
        return (global_step - start_step) / max(time.time() - start_time, 1e-9)

    def progress(self, global_step, num_updates):
        """Env steps/s and updates/s since the last report, the last evaluation and the ETA: on a terminal a line
        rewritten every second, in a log (Slurm, a sweep) a line after 10 s and then every minute."""
        now, (then, last_step, last_updates) = time.time(), self.last_report
        if now - then < (1.0 if self.tty else 60.0 if self.reported else 10.0):
            return
        sps, ups = (global_step - last_step) / (now - then), (num_updates - last_updates) / (now - then)
        left = max(self.args.total_timesteps - global_step, 0)
        eta = datetime.timedelta(seconds=int(left / sps)) if sps else "-"
        line = (f"step {global_step}/{self.args.total_timesteps} ({1 - left / self.args.total_timesteps:.0%}) | "
                f"{sps:.0f} steps/s | {ups:.0f} updates/s | last eval {self.eval_text} | ETA {eta}")
        if self.tty:  # rewritten in place until a line of its own (self.say) follows
            print("\r\033[K" + line, end="", flush=True)
        else:
            self.say(line)
        self.last_report, self.reported, self.pending = (now, global_step, num_updates), True, self.tty

    def say(self, line):
        """Print a line of its own; on a terminal, in place of the progress line."""
        print(("\r\033[K" if self.pending else "") + line, flush=True)
        self.pending = False

    def log_episode(self, global_step, episode_return, episode_length):
        self.writer.add_scalar("charts/episodic_return", episode_return, global_step)
        self.writer.add_scalar("charts/episodic_length", episode_length, global_step)

    def record(self, global_step, update, **metrics):
        """Keep one update's metrics (scalar tensors, on the device); check and log them every --log-freq updates."""
        self.sps_start = self.sps_start or (global_step, time.time())
        self.names = list(metrics)
        self.history.append(torch.stack(list(metrics.values())))
        self.updates.append((update, global_step))
        if len(self.history) == self.args.log_freq:
            self.flush(global_step)

    def flush(self, global_step, cause=None):
        """Stop on the first non-finite metric since the last log, or else on `cause`; log the metrics' means."""
        values = torch.stack(self.history) if self.history else None
        bad = [] if values is None else (~torch.isfinite(values)).nonzero().tolist()
        if bad:
            (update, step), name = self.updates[bad[0][0]], self.names[bad[0][1]]
            cause = f"{name} in update {update}, at global_step {step}"
        if cause:
            fail(f"non-finite {cause}; stopping. Last checkpoint: "
                 f"{self.checkpoint_path if os.path.exists(self.checkpoint_path) else 'none'}")
        if values is not None:
            for name, value in zip(self.names, values.mean(0).tolist()):
                self.writer.add_scalar(f"losses/{name}", value, global_step)
            self.writer.add_scalar("charts/SPS", int(self.sps(global_step)), global_step)
        self.history, self.updates = [], []

    def check_finite(self, global_step, **arrays):
        """Stop if a host array (an action, an observation) is not finite, naming it, or any non-finite metric."""
        for name, array in arrays.items():
            if not np.isfinite(array).all():
                self.flush(global_step, cause=f"{name} at global_step {global_step}")

    def evaluate(self, global_step, policy):
        """Evaluate `policy` into evaluations.csv and TensorBoard, and print a progress line."""
        self.flush(global_step)
        video_folder = os.path.join("videos", self.name) if self.args.capture_video else None
        returns = evaluate(policy, self.args.env_id, self.args.eval_episodes, self.args.seed + 100_000, self.device,
                           video_folder, video_prefix=f"step-{global_step}")
        mean, std = float(np.mean(returns)), float(np.std(returns))
        self.writer.add_scalar("eval/episodic_return", mean, global_step)
        path = os.path.join(self.dir, "evaluations.csv")
        new_file = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            if new_file:
                csv.writer(f).writerow(["global_step", "wall_time_s", "mean_return", "std_return", "returns"])
            csv.writer(f).writerow([global_step, round(self.elapsed(), 1), mean, std,
                                    " ".join(f"{r:.2f}" for r in returns)])
        self.result = {"run_dir": self.dir, "global_step": global_step, "eval_mean": mean, "eval_std": std}
        self.eval_text = f"{mean:.1f} +- {std:.1f}"
        self.say(f"step {global_step}/{self.args.total_timesteps} | eval return {self.eval_text}")

    def elapsed(self):
        return self.wall_time + time.time() - self.start_time

    def save_checkpoint(self, state, counters, envs, episodes):
        """Write everything needed to continue: `state`, the loop's counters (global_step first), the envs and their
        episodes, every RNG. After a SIGINT/SIGTERM, exit once it is written."""
        self.flush(counters[0])
        checkpoint = {"args": asdict(self.args), "run_name": self.name, "global_step": counters[0],
                      "wall_time": self.elapsed(), "counters": counters,
                      "state": {name: value.bit_generator.state if isinstance(value, np.random.Generator)
                                else value.cpu() if isinstance(value, torch.Tensor)
                                else asdict(value) if isinstance(value, CheckpointPolicy)
                                else value.state_dict() for name, value in state.items()},
                      "envs": [env_state(env) for env in envs], "episodes": episodes,
                      "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state(),
                              "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
        torch.save(checkpoint, self.checkpoint_path + ".tmp")
        os.replace(self.checkpoint_path + ".tmp", self.checkpoint_path)  # a kill while writing leaves the old one whole
        if self.stop:
            print(f"{signal.Signals(self.stop[0]).name} at global_step {counters[0]}: checkpoint written to "
                  f"{self.checkpoint_path}; continue with --resume {self.checkpoint_path}", file=sys.stderr)
            sys.exit(128 + self.stop[0])

    def restore(self, checkpoint, state, envs):
        """Load a checkpoint into `state`, the envs and the RNGs; returns the loop's counters and the envs' episodes
        (None when the envs' state cannot be restored: the run then starts new episodes)."""
        for name, value in state.items():
            if isinstance(value, np.random.Generator):
                value.bit_generator.state = checkpoint["state"][name]
            elif isinstance(value, torch.Tensor):
                value.copy_(checkpoint["state"][name])
            elif isinstance(value, CheckpointPolicy):
                value.__dict__.update(checkpoint["state"][name])
            else:
                value.load_state_dict(checkpoint["state"][name])
        episodes = checkpoint["episodes"]
        if all("mujoco" in saved or "state" in saved for saved in checkpoint["envs"]):
            for env, saved in zip(envs, checkpoint["envs"]):
                set_env_state(env, saved)
        else:
            print(f"warning: cannot restore the state of {self.args.env_id}; the resumed run starts new episodes",
                  file=sys.stderr)
            episodes = None
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if torch.cuda.is_available() and checkpoint["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
        self.wall_time = checkpoint["wall_time"]
        print(f"resumed {self.dir} at global_step {checkpoint['global_step']}", flush=True)
        return checkpoint["counters"], episodes

    def save_buffer(self, rb, low, high):
        """Write the replay buffer to buffer.npz in the --dataset format, actions in the env's units."""
        obs, action, reward, terminated, next_obs = (x.cpu().numpy() for x in rb.data[: len(rb)].split(rb.split, 1))
        np.savez(os.path.join(self.dir, "buffer.npz"), observations=obs, actions=to_env(action, low, high),
                 rewards=reward[:, 0], next_observations=next_obs, terminals=terminated[:, 0])

    def save_model(self, **networks):
        """Write the final networks, on the CPU, to model.pt."""
        torch.save({**{name: {k: v.cpu() for k, v in net.state_dict().items()} for name, net in networks.items()},
                    "args": asdict(self.args)}, os.path.join(self.dir, "model.pt"))

    def close(self):
        if self.pending:  # end the progress line before any last message
            print()
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        self.writer.close()
        if self.args.track:
            import wandb

            wandb.finish()


if __name__ == "__main__":
    main(parse_args())
