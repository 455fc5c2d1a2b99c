"""TD7: TD3 + SALE embeddings + LAP replay + policy checkpoints (+ offline mode), in one file.

Paper: Fujimoto, Chang, Smith, Gu, Precup, Meger, "For SALE: State-Action Representation Learning for Deep
Reinforcement Learning", NeurIPS 2023, https://arxiv.org/abs/2306.02451. Defaults and the order of every update are the
authors' code (sfujim/TD7). Deliberate differences from it, none of which changes the algorithm:
- gymnasium 1.x vector envs in same-step autoreset mode: a time-limit truncation keeps its bootstrap and
  stores the true final observation (the authors' `done = 0 at the time limit`, made exact).
- The replay buffer, its LAP priorities and the max-priority and value-clip bookkeeping live on the training device, so
  an update never waits for it (the authors read two maxima back to the host every update). Sampling is theirs.
- Networks never trained directly (targets, fixed encoders, checkpoints) hold no gradients; the actor update computes
  none for the critic or the fixed encoder (the authors compute and drop them), and the critic's and the actor's first
  layers none for the fixed embeddings (CatLinear). Adam is fused (the same update rule). The names are CleanRL's.
- With --no-checkpoints and --num-envs N, each vector step runs N training steps (one per env step).
- A signal (SIGINT, SIGTERM, SIGHUP) is acted on between two updates, also inside a training burst: the
  checkpoint keeps the updates still due, and the resumed run makes them before its next env step.
- The LAP-Huber threshold follows --min-priority (the authors fix it at 1; the same at the default).
- Evaluation starts its --eval-episodes episodes from the same seeds every time (so every checkpoint policy is
  judged on the same start states; the authors' single evaluation env keeps advancing between evaluations).
- The critic's two heads are separate networks, as the authors' (not one batched module as in td3_continuous.py).
- On a GPU the update steps run as CUDA graphs (--no-cudagraphs: eager, as ever); and --compile: docs/fast_path.md.
- Added: periodic evaluation into evaluations.csv, checkpoints of the whole run with --resume, signal handling, a guard
  against non-finite losses, one-line errors for bad input, --save-buffer.

Offline mode (--offline --dataset PATH), the authors' D4RL mode: a fixed .npz dataset, the TD3+BC term, no policy
checkpoints; global_step counts training steps. The file holds finite float arrays observations (N, obs_dim), actions
(N, act_dim) in the env's units and bounds, rewards (N,), next_observations (N, obs_dim) and terminals (N,) (1 where
the episode terminated, else 0, time-limit truncations too), N at least --batch-size; --save-buffer writes this format.

Two parts: the algorithm, from here to `main`; below the banner after it, the run machinery.
"""
import contextlib
import copy
import csv
import datetime
import fcntl
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import sys
import time
import types
import warnings
from dataclasses import asdict, dataclass
from functools import partial
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

# The -v4 MuJoCo envs are kept on purpose: the published results this project compares with use them.
warnings.filterwarnings("ignore", message=".*is out of date. You should consider upgrading.*")


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (python, numpy, torch and the envs)"""
    torch_deterministic: bool = False
    """on a GPU, the same numbers every run: deterministic algorithms, at a price (docs/fast_path.md)"""
    cuda: bool = True
    """use the GPU if there is one"""
    torch_threads: int = 0
    """CPU threads for torch: 0 chooses them as the run goes (the CPUs this process may use that other processes
    leave idle, one when none is; rechecked every 2 s, shown on the progress line); N fixes N (docs/command_line.md)"""
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
    cudagraphs: bool = True
    """on a GPU, each update step captured once as a CUDA graph and replayed (--no-cudagraphs: eager)"""

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
    """training steps (updates, as the authors count them; not env steps) before checkpoints judge more episodes"""
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


class CatLinear(nn.Linear):
    """nn.Linear of torch.cat(parts, 1), the same numbers, whose backward skips the input gradient of parts that need
    none (the fixed embeddings): 7% of an update's FLOPs on Hopper-v4 (benchmark/profile_update.py)."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight, bias, *parts):
            ctx.widths, x = [part.shape[1] for part in parts], torch.cat(parts, 1)
            ctx.save_for_backward(weight, x)
            return F.linear(x, weight, bias)

        @staticmethod
        def backward(ctx, grad):
            (weight, x), (needs_weight, needs_bias, *needs) = ctx.saved_tensors, ctx.needs_input_grad
            parts = [grad.mm(w) if need else None for w, need in zip(weight.split(ctx.widths, 1), needs)]
            return grad.t().mm(x) if needs_weight else None, grad.sum(0) if needs_bias else None, *parts

    def forward(self, parts):
        return self.Function.apply(self.weight, self.bias, *parts)


class Actor(nn.Module):
    """pi(s, zs): a0 = AvgL1Norm(Linear(s)), then [a0, zs] through a 256-256 ReLU MLP with a tanh output in [-1, 1]."""

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.l0 = nn.Linear(obs_dim, hidden)
        self.net = nn.Sequential(CatLinear(zs_dim + hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, act_dim), nn.Tanh())

    def forward(self, obs, zs):
        return self.net((AvgL1Norm(self.l0(obs)), zs))


class Critic(nn.Module):
    """Two heads Q_i(s, a, zsa, zs): AvgL1Norm(Linear([s, a])), zsa, zs through a 256-256 ELU MLP; Q: (batch, 2)."""

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.q0 = nn.ModuleList(nn.Linear(obs_dim + act_dim, hidden) for _ in range(2))
        self.heads = nn.ModuleList(
            nn.Sequential(CatLinear(2 * zs_dim + hidden, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                          nn.Linear(hidden, 1)) for _ in range(2))

    def forward(self, obs, action, zsa, zs):
        sa = torch.cat([obs, action], 1)
        return torch.cat([head((AvgL1Norm(q0(sa)), zsa, zs)) for q0, head in zip(self.q0, self.heads)], 1)

    def fixed(self, obs, action, zsa, zs):
        """Q values with the critic's weights held fixed: gradients reach the action and zsa, not the critic."""
        params = {name: p.detach() for name, p in self.named_parameters()}
        return torch.func.functional_call(self, params, (obs, action, zsa, zs))


class LAPReplayBuffer:
    """LAP replay in one preallocated float32 tensor on the training device, a priority per row. A row is [obs, action,
    reward, terminated, next_obs], actions in [-1, 1], written by slice from one async upload per vector step. New rows
    get the max priority; a batch is drawn in proportion to priority (exactly, as the authors) into `self.batch`, fixed
    in memory (for CUDA graphs); no importance weights. The length is a device tensor: sampling reads no host number."""

    def __init__(self, capacity, obs_dim, act_dim, batch_size, device, whole_ring=False):
        self.capacity, self.device, self.pos, self.full, self.whole_ring = capacity, device, 0, False, whole_ring
        self.split = [obs_dim, act_dim, 1, 1, obs_dim]
        self.data, self.batch = (torch.zeros(rows, sum(self.split), device=device) for rows in (capacity, batch_size))
        self.priority, self.max_priority = torch.zeros(capacity, device=device), torch.ones((), device=device)
        self.idx = torch.zeros(batch_size, dtype=torch.int64, device=device)  # the last batch's rows
        self.length = torch.zeros((), dtype=torch.int64, device=device)
        self.exact = torch.device(device).type == "cuda" and torch.are_deterministic_algorithms_enabled()  # see sample

    def __len__(self):
        return self.capacity if self.full else self.pos

    def add(self, obs, action, reward, terminated, next_obs):
        """Store one row per env (or a whole dataset), at the current max priority."""
        rows = upload(np.concatenate([obs, action, reward[:, None], terminated[:, None], next_obs], 1), self.device)
        first = min(len(rows), self.capacity - self.pos)  # the rows before the ring wraps around
        for target, source in ((self.data, rows), (self.priority, self.max_priority.expand(len(rows)))):
            target[self.pos : self.pos + first], target[: len(rows) - first] = source[:first], source[first:]
        self.full = self.full or self.pos + len(rows) >= self.capacity
        self.pos = (self.pos + len(rows)) % self.capacity
        self.length.fill_(len(self))

    def sample(self):
        """obs, action, reward, terminated, next_obs; reward and terminated of shape (batch, 1)."""
        # Over the rows written (compiled or captured: the whole ring, unwritten rows at priority 0, shapes fixed).
        priority = self.priority if self.whole_ring else self.priority[: len(self)]
        if self.exact:  # a GPU's float cumsum is not deterministic; a sum of integers (priorities in units of 2**-20)
            # is exact, and so is an integer draw modulo their total (a float64 draw would be float32 under --compile)
            csum = torch.cumsum((priority.double() * 2**20).round().long(), 0)
            value = torch.randint(0, 2**62, (len(self.batch),), device=self.device) % csum[-1]
        else:
            csum = torch.cumsum(priority, 0)
            value = torch.rand(len(self.batch), device=self.device) * csum[-1]
        self.idx.copy_(torch.searchsorted(csum, value, right=self.exact).clamp(max=self.length - 1))
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
        self.pos, self.full = state["pos"], state["full"]
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


def copy_weights(*pairs):
    """Each (target, source) pair in turn: the target takes the source's weights."""
    for target, source in pairs:
        target.load_state_dict(source.state_dict())


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
        value_range.copy_(torch.stack((value_range[0].minimum(target.min()), value_range[1].maximum(target.max()))))
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
    """One update on a new batch: encoder, critic, LAP priorities and, with_actor, the actor; its metrics by name."""
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

    A policy is judged on the minimum return of its episodes: 1 episode at first, max_eps_when_checkpointing after
    steps_before_checkpointing training steps. It becomes the checkpoint if it does at least as well as the checkpoint
    did; as soon as one episode does worse, judging stops early. Either way, the agent then trains for as many updates
    as the judged episodes took steps."""
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

    def state_dict(self):
        return asdict(self)

    def load_state_dict(self, state):
        self.__dict__.update(state)


def true_next_obs(next_obs, infos):
    """Same-step autoreset: next_obs of a finished env is already the next episode's first observation; the
    transition must store the true final one."""
    real_next_obs = next_obs.copy()
    for i in np.flatnonzero(infos.get("_final_obs", [])):
        real_next_obs[i] = infos["final_obs"][i]
    return real_next_obs


def act(actor, encoder, obs, noise=0.0):
    """pi(s, f(s)) of `actor` on the embedding of `encoder`, plus exploration noise N(0, noise), clipped to [-1, 1]."""
    action = actor(obs, encoder.zs(obs))
    return (action + torch.randn_like(action) * noise).clamp(-1.0, 1.0) if noise else action


DATASET_KEYS = ("observations", "actions", "rewards", "next_observations", "terminals")


def load_dataset(args, obs_dim, act_dim, low, high):
    """The --dataset arrays (format in the module docstring), actions normalised to [-1, 1]; refused with one line
    unless they are transitions of this env that TD7 can train on."""
    path = args.dataset
    try:
        with np.load(path) as data:
            d = {key: data[key] for key in DATASET_KEYS}
    except Exception as e:
        fail(f"cannot read --dataset {path}", e)
    rows = len(d["observations"]) if d["observations"].ndim else "N"
    if rows == 0:
        fail(f"--dataset {path} holds no transitions")
    for key, width in zip(DATASET_KEYS, (obs_dim, act_dim, None, obs_dim, None)):
        if not np.can_cast(d[key].dtype, np.float64, "same_kind"):  # complex numbers, text
            fail(f"--dataset {path}: {key} holds values of type {d[key].dtype}; TD7 needs real numbers")
        d[key] = d[key].astype(np.float64)
        shape = (rows,) if width is None else (rows, width)
        if d[key].shape != shape:
            needs = str(shape).replace("'", "")  # (N, 1) where the observations have no rows
            fail(f"--dataset {path}: {key} has shape {d[key].shape}, the env needs {needs}")
        bad = np.argwhere(~np.isfinite(d[key]))
        if len(bad):
            where = f"row {bad[0][0]}" + (f", column {bad[0][1]}" if width else "")
            fail(f"--dataset {path}: {key} holds a non-finite value, {d[key][tuple(bad[0])]}, in {where}")
    (bad,) = np.nonzero((d["terminals"] != 0) & (d["terminals"] != 1))
    if len(bad):
        fail(f"--dataset {path}: terminals must be 0 or 1, but row {bad[0]} holds {d['terminals'][bad[0]]}")
    beyond = np.maximum(d["actions"] - high, low - d["actions"])  # how far outside the bounds, in the env's units
    row, column = np.unravel_index((beyond / (high - low)).argmax(), beyond.shape)
    if beyond[row, column] > 1e-5 * (high - low)[column]:  # more than the float32 rounding of a saved buffer
        fail(f"--dataset {path}: actions lie outside the env's bounds, by up to {beyond[row, column]:.4g} (row {row}, "
             f"column {column}: {d['actions'][row, column]:.4g}, bounds [{low[column]:.4g}, {high[column]:.4g}])")
    if rows < args.batch_size:
        fail(f"--dataset {path} holds {rows} transitions, fewer than --batch-size {args.batch_size}")
    d["actions"] = np.clip(2.0 * (d["actions"] - low) / (high - low) - 1.0, -1.0, 1.0)
    return d


def buffer_as_dataset(rb, low, high):
    """--save-buffer: the replay buffer's rows as --dataset arrays, actions in the env's units."""
    obs, action, reward, terminated, next_obs = (x.cpu().numpy() for x in rb.data[: len(rb)].split(rb.split, 1))
    return dict(zip(DATASET_KEYS, (obs, to_env(action, low, high), reward[:, 0], next_obs, terminated[:, 0])))


def crossed(step, freq, step_size):
    """True when the last step_size steps, ending at step, crossed a multiple of freq (never when freq is 0)."""
    return freq > 0 and step // freq != (step - step_size) // freq


def main(args):
    check_args(args)
    checkpoint = args.resume and read_checkpoint(args.resume, args)
    envs = gym.vector.SyncVectorEnv([make_env(args.env_id) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    dataset = load_dataset(args, obs_dim, act_dim, low, high) if args.offline else None  # checked as the flags are
    capacity = len(dataset["observations"]) if args.offline else args.buffer_size

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)  # the random actions before learning starts

    sizes = (obs_dim, act_dim, args.zs_dim, args.hidden_dim)  # of the networks
    device = choose_device(args, (capacity + args.batch_size) * (2 * obs_dim + act_dim + 3) * 4)  # rows, priorities
    encoder, actor, qf = (Network(*sizes).to(device) for Network in (Encoder, Actor, Critic))  # (seeded in this order)
    fixed_encoder, fixed_encoder_target, checkpoint_encoder = (frozen_copy(encoder) for _ in range(3))
    actor_target, checkpoint_actor, qf_target = frozen_copy(actor), frozen_copy(actor), frozen_copy(qf)
    value_range, value_clip = torch.tensor([1e8, -1e8], device=device), torch.zeros(2, device=device)  # (update_critic)
    # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
    adam = partial(torch.optim.Adam, fused=True, capturable=args.cudagraphs)
    encoder_optimizer = adam(encoder.parameters(), lr=args.encoder_lr)
    q_optimizer = adam(qf.parameters(), lr=args.q_lr)
    actor_optimizer = adam(actor.parameters(), lr=args.policy_lr)
    rb = LAPReplayBuffer(capacity, obs_dim, act_dim, args.batch_size, device, args.compile or args.cudagraphs)
    update_steps = [accelerate(partial(update, rb, encoder, actor, qf, fixed_encoder, fixed_encoder_target,
                                       actor_target, qf_target, value_range, value_clip, encoder_optimizer,
                                       q_optimizer, actor_optimizer, args, with_actor), args)
                    for with_actor in (False, True)]  # the updates as callables, without and with the actor step
    if args.offline and not checkpoint:
        rb.add(*(dataset[key] for key in ("observations", "actions", "rewards", "terminals", "next_observations")))
    policy, use_checkpoints = CheckpointPolicy(), args.checkpoints and not args.offline  # TD7's, online only
    # Everything a checkpoint holds besides the loop's values and the envs: --resume restores exactly these.
    state = {"encoder": encoder, "actor": actor, "qf": qf, "fixed_encoder": fixed_encoder,
             "fixed_encoder_target": fixed_encoder_target, "checkpoint_encoder": checkpoint_encoder,
             "actor_target": actor_target, "checkpoint_actor": checkpoint_actor, "qf_target": qf_target,
             "value_bounds": nn.ParameterDict({"range": value_range, "clip": value_clip}),  # (sharing the tensors)
             "encoder_optimizer": encoder_optimizer, "q_optimizer": q_optimizer, "actor_optimizer": actor_optimizer,
             "rb": rb, "policy": policy, "rng": rng}
    # Evaluation and the saved model use the checkpoint policy when there is one.
    eval_actor, eval_encoder = (checkpoint_actor, checkpoint_encoder) if use_checkpoints else (actor, fixed_encoder)
    obs, _ = envs.reset(seed=args.seed)
    start = {"global_step": 0, "num_updates": 0, "updates_due": 0, "allow_train": args.offline, "obs": obs,
             "episode_return": np.zeros(args.num_envs), "episode_length": np.zeros(args.num_envs, dtype=np.int64),
             "actor_loss": torch.zeros(())}  # the last: the policy is updated less often
    loop = restore(checkpoint, state, envs.envs, start) if checkpoint else start
    global_step, num_updates, updates_due, allow_train, actor_loss, obs, episode_return, episode_length = (loop[name]
        for name in ("global_step", "num_updates", "updates_due", "allow_train", "actor_loss", *EPISODE_VALUES))
    obs_on_device = upload(obs, device)
    metrics = {"actor_loss": actor_loss.to(device)}  # the last of each
    run = Run(args, checkpoint, device)
    try:
        if run.evaluation_due:  # the checkpoint's evaluation, which a signal interrupted
            run.evaluate_and_log(global_step, partial(act, eval_actor, eval_encoder))
            run.exit_on_signal(global_step, updates_due)  # the checkpoint resumed from still holds it all
        while global_step < args.total_timesteps or updates_due:
            if args.offline and not updates_due:  # one update per step, on the dataset
                global_step, updates_due = global_step + 1, 1
            elif not updates_due:
                if not allow_train:
                    action = rng.uniform(-1.0, 1.0, (args.num_envs, act_dim))
                else:
                    with torch.no_grad():
                        action = act(actor, fixed_encoder, obs_on_device, args.exploration_noise).cpu().numpy()
                    run.metrics.check_finite(global_step, action=action)  # on the host anyway: a free check
                next_obs, reward, terminated, truncated, infos = envs.step(to_env(action, low, high))
                global_step += args.num_envs
                run.metrics.check_finite(global_step, reward=reward, observation=next_obs)
                updates_due = args.num_envs if allow_train and not use_checkpoints else 0  # else bursts, episode ends
                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(terminated | truncated):
                    run.metrics.writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    run.metrics.writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    if allow_train and use_checkpoints:
                        take_checkpoint, updates = policy.episode_end(int(episode_length[i]), float(episode_return[i]))
                        if take_checkpoint:
                            copy_weights((checkpoint_actor, actor), (checkpoint_encoder, fixed_encoder))
                        updates_due += updates
                    allow_train = allow_train or global_step > args.learning_starts
                    episode_return[i], episode_length[i] = 0.0, 0
                rb.add(obs, action, reward, terminated, true_next_obs(next_obs, infos))
                obs, obs_on_device = next_obs, upload(next_obs, device)

            while updates_due and not run.signal:  # a signal stops a burst between updates; the resumed run ends it
                if use_checkpoints:
                    policy.before_update(num_updates, args)
                num_updates, updates_due = num_updates + 1, updates_due - 1
                metrics.update(update_steps[num_updates % args.policy_frequency == 0]())
                if num_updates % args.target_update_rate == 0:  # the cascade: each target takes what it follows
                    copy_weights((actor_target, actor), (qf_target, qf), (fixed_encoder_target, fixed_encoder),
                                 (fixed_encoder, encoder))  # the fixed target takes the old fixed encoder first
                    rb.reset_max_priority()
                    value_clip.copy_(value_range)
                run.metrics.record(global_step, num_updates, **metrics)

            run.progress.update(global_step, num_updates)
            done = global_step >= args.total_timesteps
            if (crossed(global_step, args.eval_freq, args.num_envs) or done) and not updates_due:  # after the burst
                run.evaluate_and_log(global_step, partial(act, eval_actor, eval_encoder))
            if run.signal or (done and args.checkpoint_freq) or crossed(global_step, args.checkpoint_freq,
                                                                         args.num_envs):
                run.save_checkpoint(state, envs.envs, global_step=global_step, num_updates=num_updates,
                                    updates_due=updates_due, allow_train=allow_train, obs=obs,
                                    episode_return=episode_return, episode_length=episode_length,
                                    actor_loss=metrics["actor_loss"])
                run.exit_on_signal(global_step, updates_due)
        if args.save_model:  # the final networks (of the checkpoint policy, with one), on the CPU, and the arguments
            networks = {"actor": eval_actor, "encoder": eval_encoder, "qf": qf}
            model = {name: net.cpu().state_dict() for name, net in networks.items()}
            write_atomically(f"{run.dir}/model.pt", partial(torch.save, {**model, "args": asdict(args)}), mode="wb")
        if args.save_buffer:
            write_atomically(f"{run.dir}/buffer.npz", partial(np.savez, **buffer_as_dataset(rb, low, high)), mode="wb")
        run.finished = True
    finally:
        envs.close()
        run.close()
    return run.result


# ======================================================================================================================
# Part 2: the run machinery. Nothing below changes what is computed: it checks the input before anything is written,
# owns the run's directory (one writer, files written whole), evaluates, and stops on a non-finite number or a signal.
# ======================================================================================================================

# Flags a resume may change: they change how a run is watched, not what it computes.
WATCH_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video"}
WATCH_FLAGS |= {"save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda"}
WATCH_FLAGS |= {"save_buffer"}  # TD7's: a file written at the end
OFFLINE_IGNORES = ["buffer_size", "learning_starts", "exploration_noise", "num_envs", "checkpoints", "reset_weight",
                   "max_eps_when_checkpointing", "steps_before_checkpointing"]  # TD7's: online flags, refused offline
EPISODE_VALUES = ["obs", "episode_return", "episode_length"]  # the loop's values of the envs' running episodes
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def fail(message, error=None):
    """Stop with one line on stderr (above a progress bar), `error`'s first line after the message, and exit 1."""
    words = (str(error).splitlines() or [type(error).__name__])[0] if error is not None else ""
    tqdm.write(f"error: {message}" + f": {words}" * bool(words), file=sys.stderr)
    sys.exit(1)


def exit_outside_the_run(signum, frame):
    """A signal before the run has its directory or after its files are written: one line, no cleanup to interrupt."""
    with contextlib.suppress(OSError):  # stderr gone with its terminal (SIGHUP): the exit still comes
        print(f"{signal.Signals(signum).name} outside the run: nothing to save", file=sys.stderr)
    os._exit(128 + signum)


def check_args(args):
    """One line unless the numeric flags are finite and in range, the flags agree and --env-id names one version of an
    env this script can learn (and record, with video)."""
    positive = ["total_timesteps", "num_envs", "buffer_size", "batch_size", "eval_episodes", "log_freq"]
    positive += ["policy_frequency", "target_update_rate", "encoder_lr", "q_lr", "policy_lr", "zs_dim", "hidden_dim"]
    positive += ["max_eps_when_checkpointing", "min_priority", "reset_weight"]  # TD7's flags
    for name, value in asdict(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not np.isfinite(value):
            fail(f"{flag} must be a finite number, got {value}")
        if isinstance(value, (int, float)) and (value <= 0 if name in positive else value < 0):
            fail(f"{flag} must be {'positive' if name in positive else 'non-negative'}, got {value}")
        if name in ["gamma", "reset_weight"] and not 0 <= value <= 1:  # TD7's, for TD3's tau
            fail(f"{flag} must lie in [0, 1], got {value}")
        if args.offline and name in OFFLINE_IGNORES and value != getattr(Args, name):  # TD7's offline mode
            fail(f"{flag.replace('--', '--no-' if value is False else '--')} has no effect with --offline: it trains "
                 "on the whole dataset, one update per step, without policy checkpoints")
    # An --env-id without a version: gymnasium would run the latest silently, in a directory not saying which.
    versions = sorted(i for i in gym.registry if i.rsplit("-v", 1)[0] == args.env_id)
    problems = {
        f"--env-id {args.env_id} names no version; gymnasium has {', '.join(versions)}": bool(versions),
        f"--seed must lie in [0, 2**31), got {args.seed}": not 0 <= args.seed < 2**31,
        "--eval-episodes must be at most 1000": args.eval_episodes > 1000,
        f"--batch-size {args.batch_size} is larger than --buffer-size": args.batch_size > args.buffer_size,
        "--learning-starts must be below --total-timesteps": args.learning_starts >= args.total_timesteps
        and not args.offline,  # TD7: offline has none
        f"--exp-name {args.exp_name!r} must be a plain file name of 1-100 characters": not (
            0 < len(args.exp_name) <= 100 and "/" not in args.exp_name and not args.exp_name.startswith(".")),
        "--resume needs the path of a checkpoint.pt": args.resume == "",
        "--offline needs --dataset PATH": args.offline and not args.dataset,  # TD7's offline mode, and its checkpoints
        "--dataset is only read with --offline": args.dataset and not args.offline,
        "--num-envs above 1 needs --no-checkpoints: a checkpoint judges whole episodes of one policy": (
            args.num_envs > 1 and args.checkpoints),
        "--track needs wandb: pip install wandb": args.track and not importlib.util.find_spec("wandb"),
    }
    for message in (message for message, problem in problems.items() if problem):
        fail(message)
    # Nothing renders without --capture-video: no render backend (MUJOCO_GL) may stop the run.
    os.environ["MUJOCO_GL"] = os.environ.get("MUJOCO_GL", "egl") if args.capture_video else "disable"
    # MuJoCo 4 warns at each load of HalfCheetah-v4 that "'settotalmass' is deprecated", also into ./MUJOCO_LOG.TXT:
    with contextlib.suppress(Exception):  # that one is dropped, any other goes to stderr (no mujoco: said below)
        importlib.import_module("mujoco").set_mju_user_warning(
            lambda text: "'settotalmass' is deprecated" in text or print(f"WARNING: {text}", file=sys.stderr))
    try:  # gymnasium raises many kinds: unknown id, missing extra, bad module path
        env = gym.make(args.env_id, render_mode="rgb_array" if args.capture_video else None)
        if args.capture_video:  # once here, as RecordVideo will: moviepy to write a frame, and a frame
            importlib.import_module("moviepy")
            env.reset(seed=0)
            env.render()
    except Exception as e:
        if args.capture_video and args.env_id in gym.registry:  # most likely a failing render backend, or no moviepy
            fail(f"--capture-video cannot record {args.env_id} (MUJOCO_GL={os.environ['MUJOCO_GL']})", e)
        fail(f"cannot make --env-id {args.env_id!r}", e)
    obs_space, act_space = env.observation_space, env.action_space
    if not isinstance(act_space, gym.spaces.Box):
        fail(f"{args.env_id} has a {type(act_space).__name__} action space; TD7 needs a Box, see sac_discrete.py")
    if len(act_space.shape) != 1 or not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        fail(f"{args.env_id} has actions {act_space}; TD7's tanh policy needs a bounded Box of one dimension")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        fail(f"{args.env_id} has {obs_space} observations; this script needs a flat vector (Box of one dimension)")
    env.close()


def read_checkpoint(path, args=None):
    """This script's checkpoint.pt at `path`, or one line why not; with `args`: same algorithm flags, steps left."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:
        fail(f"cannot read --resume file {path}", e)
    if not isinstance(checkpoint, dict) or not {"args", "loop", "state", "run"} <= checkpoint.keys():
        fail(f"--resume file {path} is not a checkpoint.pt of this script (model.pt holds only the networks)")
    if checkpoint.get("script") != os.path.basename(__file__):
        made = checkpoint.get("script", "an older version of this script")
        fail(f"--resume file {path} was made by {made}, not {os.path.basename(__file__)}")
    for name, value in asdict(args).items() if args else ():
        if name not in WATCH_FLAGS and (made := checkpoint["args"].get(name)) != value:
            fail(f"--resume file {path} was made with --{name.replace('_', '-')} {made}, not {value}")
    step = checkpoint["loop"]["global_step"]
    unfinished = checkpoint["run"]["evaluation_due"] or checkpoint["loop"]["updates_due"]  # TD7's burst can end a run
    if args and args.total_timesteps <= step and not unfinished:
        fail(f"--total-timesteps {args.total_timesteps} is not beyond the checkpoint's global_step {step}")
    return checkpoint


def restore(checkpoint, state, envs, start):
    """Load a checkpoint into `state`, the envs and RNGs and return the loop's values; one line if it does not fit."""
    try:
        for name, value in state.items():
            if isinstance(value, np.random.Generator):
                value.bit_generator.state = checkpoint["state"][name]
            else:
                value.load_state_dict(checkpoint["state"][name])
        loop = {name: checkpoint["loop"][name] for name in start}
        if all("mujoco" in saved or "state" in saved for saved in checkpoint["envs"]):
            for env, saved in zip(envs, checkpoint["envs"], strict=True):
                set_env_state(env, saved)
        else:  # an env whose state this script cannot read: new episodes, from the reset in `start`
            print("warning: cannot restore the envs' state; the resumed run starts new episodes", file=sys.stderr)
            loop.update({name: start[name] for name in EPISODE_VALUES})
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(checkpoint["rng"]["cuda"])
        return loop
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        fail("the --resume checkpoint does not fit this run", e)


def choose_device(args, buffer_bytes):
    """The training device (a warning line when --cuda finds no GPU); one line unless the replay buffer fits in its
    free memory and (a checkpoint's copy) the host's."""
    if args.cuda and not torch.cuda.is_available():
        print("warning: no GPU is available; running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    args.cudagraphs = args.cudagraphs and device.type == "cuda"  # as it runs (args.json, the checkpoint)
    if device.type == "cuda" and args.torch_deterministic:  # the CPU's ops are deterministic already
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition, before its first use
        torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any op that has no such version
    free = {"cpu": int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024}
    free["cuda"] = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    need = {"cuda": buffer_bytes, "cpu": buffer_bytes} if device.type == "cuda" else {"cpu": 2 * buffer_bytes}
    for kind in (kind for kind in need if need[kind] > free[kind]):
        fail(f"the replay buffer needs {need[kind] / 2**30:.1f} GiB, more than the {free[kind] / 2**30:.1f} GiB "
             f"free on the {kind}; lower --buffer-size or --batch-size")
    return device


class Threads:
    """--torch-threads 0 (benchmark/results/threads.md): every 2 s, as many threads as the CPUs others left idle."""

    def __init__(self):
        self.most, self.rising, self.last = torch.get_num_threads(), False, self.reading()
        self.checked = time.monotonic()
        torch.set_num_threads(1)

    def reading(self):  # (time, CPU seconds others used of this process's CPUs, its CPUs), or None (no /proc/stat)
        with contextlib.suppress(OSError, AttributeError, ValueError):
            cpus, stat = os.sched_getaffinity(0), [line.split() for line in open("/proc/stat")]  # "cpuN" and ticks
            busy = [sum(map(int, t[:8])) - int(t[3]) - int(t[4]) for n, *t in stat if n[3:] in map(str, cpus)]
            return time.monotonic(), sum(busy) / os.sysconf("SC_CLK_TCK") - sum(os.times()[:2]), len(cpus)

    def choose(self):
        now, was, threads = self.reading(), self.last, torch.get_num_threads()
        idle = now[2] - max(now[1] - was[1], 0.0) / max(now[0] - was[0], 1e-3) if now and was else 1
        fits = max(1, min(self.most, int(idle + 0.2)))  # (a core a fifth used is busy)
        torch.set_num_threads(fits if fits < threads or self.rising else threads)  # fewer at once, more when two say
        self.rising, self.last, self.checked = fits > torch.get_num_threads(), now, time.monotonic()


def accelerate(step, args):
    """An update step (a callable without arguments) as it is, torch.compile'd, and/or replayed as a CUDA graph."""
    step = torch.compile(step) if args.compile else step
    return CudaGraph(step) if args.cudagraphs else step


class CudaGraph:
    """--cudagraphs: `step` run eagerly, captured once, then replayed; its tensors stay in place, outputs are reused."""

    def __init__(self, step, warmup=3):
        self.step, self.warmup, self.graph = step, warmup, None

    def __call__(self):
        if self.warmup:
            self.warmup, stream = self.warmup - 1, torch.cuda.Stream()
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


def env_state(env):
    """What it takes to continue one env's episode bit for bit: its RNG, time-limit counter and physics."""
    u, state = env.unwrapped, {"np_random": env.unwrapped.np_random.bit_generator.state}
    with contextlib.suppress(AttributeError):  # an env without a time limit has no counter
        state["elapsed_steps"] = env.get_wrapper_attr("_elapsed_steps")
    if hasattr(u, "model") and hasattr(u, "data"):  # MuJoCo: the full integration state, warm-start included
        import mujoco
        state["mujoco"] = np.empty(mujoco.mj_stateSize(u.model, mujoco.mjtState.mjSTATE_INTEGRATION))
        mujoco.mj_getState(u.model, u.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
    elif hasattr(u, "state"):  # classic control
        state["state"] = np.array(u.state)
    return state


def set_env_state(env, state):
    u = env.unwrapped
    u.np_random.bit_generator.state = state["np_random"]
    if "elapsed_steps" in state:
        env.set_wrapper_attr("_elapsed_steps", state["elapsed_steps"])
    if "mujoco" in state:
        import mujoco
        mujoco.mj_setState(u.model, u.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_forward(u.model, u.data)
    elif "state" in state:
        u.state = state["state"]


def evaluate(policy, env_id, episodes, seed, device, stop, video_folder=None, video_prefix="eval"):
    """Returns of `episodes` full episodes of the deterministic `policy`, on a separate env; None once `stop()`."""
    env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
    if env.spec.max_episode_steps is None:
        env = gym.wrappers.TimeLimit(env, 10_000)  # an env without a time limit (MuJoCo's is 1,000 steps)
    if video_folder:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda e: e == 0, name_prefix=video_prefix)
    low, high, returns = env.action_space.low, env.action_space.high, []
    try:
        for episode in range(episodes):
            (obs, _), done, episode_return = env.reset(seed=seed + episode), False, 0.0
            while not done:
                if stop():
                    return None
                with torch.no_grad():
                    action = policy(upload(obs[None], device))[0].cpu().numpy()  # the one wait per step
                obs, reward, terminated, truncated, _ = env.step(to_env(action, low, high))
                episode_return, done = episode_return + float(reward), terminated or truncated
            returns.append(episode_return)
    finally:
        env.close()
    return returns


def write_atomically(path, write, mode="w"):
    """`path` whole or not at all (path.tmp, synced, renamed); a failed write (a full disk): one line, old file kept."""
    try:
        with open(path + ".tmp", mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a crash cannot leave an empty file under the name
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its own words
        full = shutil.disk_usage(os.path.dirname(path)).free < 2**20  # read while the temp file holds its space
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        fail(f"cannot write {path}", "no space left" if full else getattr(e, "strerror", None) or e)


def claim_run_dir(args):
    """runs/{run_name} made (-2, -3, ... if taken) or --resume's, locked by a file naming this process: one writer."""
    name = f"{args.env_id.replace('/', '-').replace(':', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
    path = os.path.dirname(os.path.abspath(args.resume)) if args.resume else os.path.abspath(os.path.join("runs", name))
    try:
        for path in [path] if args.resume else [path + f"-{n}" * (n > 1) for n in range(1, 1000)]:
            with contextlib.suppress(FileExistsError):  # (mkdir is atomic: of runs started together, one takes a name)
                os.makedirs(path, exist_ok=bool(args.resume))
                break
        lock = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"{path} is in use by {os.read(lock, 100).decode() or 'another process'}")
    except OSError as e:
        fail(f"cannot create the run directory {path}", e.strerror)
    os.ftruncate(lock, 0)
    os.pwrite(lock, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return path, lock


class Metrics:
    """TensorBoard (and W&B); the updates' metrics summed on the device, checked and logged (one wait) at log points."""

    def __init__(self, args, path, device, stop, purge_step=None, names=(), sum=None, count=0, window=(0, 0, 0, 0)):
        self.args, self.stop, self.names, self.count, self.window = args, stop, list(names), count, list(window)
        self.sum, self.sps_start = None if sum is None else sum.to(device), None  # (this process's first update)
        if args.track:  # W&B syncing the TensorBoard files (started before the writer), or one line saying why not
            name = os.path.basename(path)
            try:
                importlib.import_module("wandb").init(
                    project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, dir=path,
                    resume="allow", config=asdict(args), name=name, id=name[-64:].replace(".", "-"))
            except Exception as e:  # no key, a key wandb refuses, no server, an unknown entity
                fail("--track: wandb cannot start (wandb login, or WANDB_MODE=offline)", e)
        self.writer = SummaryWriter(path, purge_step=purge_step)  # points after it, of the run resumed, are dropped

    def record(self, global_step, update, **metrics):
        """Add one update's metrics (scalar tensors, on the device); log them every --log-freq updates."""
        self.sps_start = self.sps_start or (global_step, time.time())
        self.names, self.sum = list(metrics), torch.stack(list(metrics.values())) + (self.sum if self.count else 0)
        self.window = [update, global_step] * 2 if not self.count else self.window[:2] + [update, global_step]
        self.count += 1
        if self.count == self.args.log_freq:
            self.log(global_step)

    def means(self):
        """The means since the last log; the run stops on a non-finite one, naming it and its window."""
        means = dict(zip(self.names, (self.sum / self.count).tolist())) if self.count else {}
        for name in (name for name, value in means.items() if not np.isfinite(value)):
            self.stop("non-finite {} in updates {}-{}, from global_step {} to {}".format(name, *self.window[::2],
                                                                                         *self.window[1::2]))
        return means

    def log(self, global_step):
        """Log the means since the last log and the env steps/s of this process."""
        for name, value in self.means().items():
            self.writer.add_scalar(f"losses/{name}", value, global_step)
        if self.count and self.sps_start:  # (a resumed run's carried metrics come before this process's first update)
            sps = (global_step - self.sps_start[0]) / max(time.time() - self.sps_start[1], 1e-9)
            self.writer.add_scalar("charts/SPS", int(sps), global_step)
        self.count = 0

    def check_finite(self, global_step, **arrays):
        """Stop if a host array (an action, a reward, an observation) is not finite, naming it, before it is used."""
        for name in (name for name, array in arrays.items() if not np.isfinite(array).all()):
            self.stop(f"non-finite {name} at global_step {global_step}")


class Progress:
    """tqdm's bar (in a log, a line a minute), its ETA from the first update; torch's threads (0: `Threads`' rule)."""

    def __init__(self, args, global_step, num_updates, last_eval):
        self.tty, self.first, self.checked = sys.stdout.isatty(), None, time.monotonic()
        torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # (0: as the rule chooses, from one)
        self.threads = None if args.torch_threads else Threads()
        self.steps, self.updates, self.first_updates, self.last_eval = global_step, num_updates, num_updates, last_eval
        lines = types.SimpleNamespace(write=lambda s: s.strip() and print(s.strip(), flush=True), flush=lambda: None)
        self.bar = tqdm(total=args.total_timesteps, initial=global_step, dynamic_ncols=True, miniters=1,
                        mininterval=1 if self.tty else 60, delay=1 if self.tty else 60, postfix="ETA ?",
                        file=sys.stdout if self.tty else lines,  # in a log: a line each time, no carriage returns
                        bar_format="{percentage:3.0f}%|{bar}| {n}/{total} steps{postfix}")  # tqdm: ", " + postfix

    def update(self, global_step, num_updates):
        now = time.monotonic()
        if num_updates > self.first_updates and not self.first:  # the first update: the ETA is timed from here
            self.first = global_step, now
        if self.threads and now - self.threads.checked >= 2:
            self.threads.choose()
        if now - self.checked >= self.bar.mininterval:  # the speeds since the last time, shown until the next
            threads, elapsed, (step, start) = torch.get_num_threads(), now - self.checked, self.first or (0, now)
            sps, ups = (global_step - self.steps) / elapsed, (num_updates - self.updates) / elapsed
            eta = tqdm.format_interval((self.bar.total - global_step) * (now - start) / max(global_step - step, 1))
            self.bar.set_postfix_str(f"ETA {eta if now > start else '?'}, {sps:.0f} steps/s, {ups:.0f} updates/s, "
                                     f"last eval {self.last_eval}, {threads} thread{'s' * (threads > 1)}", False)
            self.steps, self.updates, self.checked = global_step, num_updates, now
        self.bar.update(global_step - self.bar.n)

    def say(self, line, file=None):
        """A line of its own (on stdout unless `file`); on a terminal above the bar."""
        with contextlib.suppress(OSError):  # a terminal gone (SIGHUP) cannot stop the run from saving and ending
            tqdm.write(line, file=file or sys.stdout) if self.tty else print(line, file=file or sys.stdout, flush=True)


class Run:
    """A run's directory, files, evaluations, checkpoints and signals (a flag, which the loop and evaluations poll)."""

    def __init__(self, args, checkpoint, device):
        self.args, self.device, self.signal, self.finished, self.result = args, device, None, False, None
        self.handlers = {s: signal.signal(s, lambda signum, frame: setattr(self, "signal", signum)) for s in SIGNALS}
        self.dir, self.lock = claim_run_dir(args)
        saved = checkpoint["run"] if checkpoint else {"wall_time": 0, "evaluations": [], "evaluation_due": False}
        self.evaluations, self.evaluation_due = saved["evaluations"], saved["evaluation_due"]  # rows of the csv
        self.start_time = time.time() - saved["wall_time"]
        write_atomically(f"{self.dir}/args.json", lambda f: json.dump({**asdict(args), "device": str(device)}, f))
        self.write_evaluations()  # on resume: the rows up to the checkpoint, dropping any made after it
        loop = checkpoint["loop"] if checkpoint else {"global_step": 0, "num_updates": 0}
        purge_step = loop["global_step"] + 1 if checkpoint else None
        self.metrics = Metrics(args, self.dir, device, self.stop_on, purge_step, **saved.get("metrics", {}))
        last_eval = "{2:.1f} +- {3:.1f}".format(*self.evaluations[-1]) if self.evaluations else "-"
        self.progress = Progress(args, loop["global_step"], loop["num_updates"], last_eval)
        start = f"resumed {self.dir} at global_step {loop['global_step']}" if checkpoint else f"run {self.dir}"
        how = " ".join(["compiled"] * args.compile + ["as CUDA graphs"] * args.cudagraphs) or "eager"
        self.progress.say(f"{start}: {args.env_id}, {args.total_timesteps} steps on {device}, updates {how}")

    def stop_on(self, cause):
        last = f"{self.dir}/checkpoint.pt" if os.path.exists(f"{self.dir}/checkpoint.pt") else "none"
        fail(f"{cause}; stopping. Last checkpoint: {last}")

    def evaluate_and_log(self, global_step, policy):
        """Evaluate `policy` into evaluations.csv and TensorBoard; a signal ends it at once, leaving it due."""
        self.metrics.log(global_step)
        self.evaluation_due = True
        video_folder = os.path.join("videos", os.path.basename(self.dir)) if self.args.capture_video else None
        returns = evaluate(policy, self.args.env_id, self.args.eval_episodes, self.args.seed + 100_000, self.device,
                           lambda: self.signal, video_folder, video_prefix=f"step-{global_step}")
        if returns is None:
            return
        mean, std, self.evaluation_due = float(np.mean(returns)), float(np.std(returns)), False
        self.metrics.writer.add_scalar("eval/episodic_return", mean, global_step)
        wall_time = round(time.time() - self.start_time, 1)
        self.evaluations.append([global_step, wall_time, mean, std, " ".join(f"{r:.2f}" for r in returns)])
        self.write_evaluations()
        self.result = {"run_dir": self.dir, "global_step": global_step, "eval_mean": mean, "eval_std": std}
        self.progress.last_eval = f"{mean:.1f} +- {std:.1f}"
        self.progress.say(f"step {global_step}/{self.args.total_timesteps} | eval return {self.progress.last_eval}")

    def write_evaluations(self):
        rows = [["global_step", "wall_time_s", "mean_return", "std_return", "returns"], *self.evaluations]
        write_atomically(f"{self.dir}/evaluations.csv", lambda f: csv.writer(f).writerows(rows))

    def save_checkpoint(self, state, envs, **loop):
        """Write `state`, the envs, every RNG, the loop's values by name, the evaluations and metrics (checked)."""
        self.metrics.means()
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        metrics = {k: getattr(self.metrics, k) for k in ("names", "sum", "count", "window")}  # as Metrics takes them
        run = {"wall_time": time.time() - self.start_time, "evaluations": self.evaluations,
               "evaluation_due": self.evaluation_due, "metrics": metrics}
        state = {k: v.bit_generator.state if hasattr(v, "bit_generator") else v.state_dict() for k, v in state.items()}
        checkpoint = {"script": os.path.basename(__file__), "args": asdict(self.args), "loop": loop, "run": run,
                      "state": state, "envs": [env_state(env) for env in envs], "rng": rng}
        write_atomically(f"{self.dir}/checkpoint.pt", partial(torch.save, checkpoint), mode="wb")

    def exit_on_signal(self, global_step, updates_due):
        """After a signal a run with steps (TD7's: or its burst's updates) left ends here: one line, 128 + signal."""
        if self.signal and (global_step < self.args.total_timesteps or self.evaluation_due or updates_due):
            self.progress.say(f"{signal.Signals(self.signal).name} at global_step {global_step}: checkpoint written; "
                              f"continue with --resume {self.dir}/checkpoint.pt", sys.stderr)
            sys.exit(128 + self.signal)

    def close(self):
        """A finished run's closing line; the files closed, the lock removed, the signals given back."""
        try:  # (a closed pipe or a full disk may raise here: the lock still goes, the signals still come back)
            self.progress.bar.close()
            if self.finished:
                wall_time = datetime.timedelta(seconds=int(time.time() - self.start_time))
                self.progress.say(f"finished {self.args.total_timesteps} steps in {wall_time}: final eval "
                                  f"{self.progress.last_eval}; {self.dir}")
            self.metrics.writer.close()
            if self.args.track:
                importlib.import_module("wandb").finish()
        finally:
            os.remove(f"{self.dir}/lock")
            os.close(self.lock)
            for s, handler in self.handlers.items():
                signal.signal(s, handler)
        if self.signal and self.finished:  # after the run's last checkpoint and files: nothing left to save
            exit_outside_the_run(self.signal, None)


if __name__ == "__main__":
    for s in SIGNALS:
        signal.signal(s, exit_outside_the_run)
    args = tyro.cli(Args)
    if args.resume:  # the checkpoint's arguments are the defaults
        saved = read_checkpoint(args.resume)["args"]
        args = tyro.cli(Args, default=Args(**{k: saved[k] for k in Args.__dataclass_fields__ if k in saved}))
    if args.dataset:  # TD7's: the file, whatever directory a resume runs in
        args.dataset = os.path.abspath(args.dataset)
    try:
        main(args)
    except RuntimeError as e:  # an allocation the memory check let through (CUDA's OutOfMemoryError is one too)
        if "alloc" not in str(e):
            raise
        fail("out of memory (lower --buffer-size or --batch-size)", e)
