"""ERL-TD3: Evolutionary Reinforcement Learning with TD3 learners, in one file.

Paper: Khadka, Tumer, "Evolution-Guided Policy Gradient in Reinforcement Learning", NeurIPS 2018,
https://arxiv.org/abs/1805.07917 (with DDPG); TD3 learners and the generation order as in EvoRL's ERL workflow.
A population of deterministic actors is evolved by a genetic algorithm beside K TD3 learners; all of them fill
one replay buffer. One generation, as numbered in `main`:
  1. fitness: every individual runs --episodes-for-fitness episodes without noise, all at once (one env per
     individual, one batched forward pass of the stacked population per step); fitness = mean return;
  2. each learner runs one episode with N(0, --exploration-noise) noise;
  3. TD3 updates: --utd-ratio per env step of the generation for each learner (the actor and the targets every
     --policy-frequency-th), once the buffer holds more than --learning-starts transitions;
  4. the genetic step: ERL's own (--genetic-step erl, `next_generation`: elites, tournaments, crossover of whole
     neurons, mutation of random weight entries) or EvoRL's mutation-only one (`next_generation_mutation_only`);
  5. every --rl-injection-interval generations, once the learners have trained, copies of their actors go over the
     worst individuals by the fitness before the genetic step (ERL's `run_erl.py`), whatever that step put there, at
     the next generation's start, after the champion's evaluation; their fate in the next genetic step is logged.
Learner layouts: K (actor, critic) pairs (ERL, the default), or --shared-critic: K actors and one critic (CEM-RL
style) taking one Adam step per update on the mean of the K learners' critic losses (a batch and target policy each).
Deliberate choices and differences:
- global_step and --total-timesteps count every env step, population and learners alike. Runs end, evaluate and
  checkpoint at generation boundaries (a run stops at the end of the generation that reaches the total). A
  SIGINT/SIGTERM/SIGHUP stops a generation's updates between two; its checkpoint keeps the updates still due.
- No uniform random phase: before the learners train, their untrained actors act with noise, the population explores.
- Evaluation (deterministic): the champion (the unmutated copy of the best by the last fitness) in the common
  evaluations.csv columns; the first learner in extra ones. Networks, actions and TD3's update: td3_continuous.py's.
- Losses are logged as their mean over each generation's updates (of all learners), at its end.
- On a GPU the update steps run as CUDA graphs (--no-cudagraphs: eager, as ever); and --compile: docs/fast_path.md.

Two parts: the algorithm, from here to `main`; below the banner after it, the run machinery.
"""
import contextlib
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
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
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
    learning_starts: int = 1280
    """the learners train once the buffer holds more than this many transitions (ERL's `run_erl.py`: 5 batches, 256)"""
    buffer_size: int = 1000000
    """the replay memory size"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    gamma: float = 0.99
    """the discount factor gamma"""
    eval_freq: int = 5000
    """evaluation at the end of each generation that crosses a multiple of this many env steps (0: only at the end)"""
    eval_episodes: int = 10
    """episodes per evaluation"""
    checkpoint_freq: int = 100000
    """write runs/{run_name}/checkpoint.pt every this many env steps and at the end (0: never)"""
    resume: Optional[str] = None
    """path of a checkpoint.pt to continue from (the run keeps its directory)"""
    compile: bool = False
    """torch.compile the update steps (CPU or GPU; the same numbers up to float rounding)"""
    cudagraphs: bool = True
    """on a GPU, each update step captured once as a CUDA graph and replayed (--no-cudagraphs: eager)"""

    # Algorithm specific arguments
    learning_rate: float = 3e-4
    """the learning rate of the actor and critic optimizers (unless --actor-lr, --critic-lr)"""
    actor_lr: float = 0.0
    """the learners' actor learning rate (0: --learning-rate; ERL's own: 5e-5, `core/ddpg.py`)"""
    critic_lr: float = 0.0
    """the critics' learning rate (0: --learning-rate; ERL's own: 5e-4, `core/ddpg.py`)"""
    critic_grad_clip: float = 0.0
    """clip each critic's gradient to this norm before its step (0: no clip; ERL's own: 10, `core/ddpg.py`)"""
    actor_hidden: int = 256
    """the width of every actor's two hidden layers, the population's and the learners' (ERL's own: 128)"""
    actor_layer_norm: bool = False
    """every actor with a LayerNorm after each hidden layer and tanh instead of ReLU (ERL's own, `core/ddpg.py`; its
    norm divides by the unbiased std plus 1e-6, torch's by the root of the variance plus 1e-5)"""
    learner_init_scale: float = 1.0
    """the learners' output layer scaled by this at initialisation (ERL's own: 0.1, `core/ddpg.py`'s `init=True`)"""
    tau: float = 0.005
    """target network smoothing coefficient (ERL's own: 0.001, with --batch-size 128)"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise (fraction of the action half-range)"""
    noise_clip: float = 0.5
    """clip of the target policy smoothing noise"""
    exploration_noise: float = 0.1
    """the scale of the exploration noise (fraction of the action half-range)"""
    policy_frequency: int = 2
    """the frequency of delayed actor and target updates, in critic updates"""
    utd_ratio: float = 1.0
    """critic updates of each learner per env step collected in the generation (update-to-data ratio)"""
    num_rl_agents: int = 1
    """K, the number of TD3 learners"""
    shared_critic: bool = False
    """K actors with one shared critic (CEM-RL style) instead of K (actor, critic) pairs"""

    # Evolution
    pop_size: int = 10
    """the number of individuals (actors) in the population"""
    num_elites: int = 2
    """the best individuals, copied unchanged into the next generation (at least 1)"""
    tournament_size: int = 3
    """individuals drawn per tournament; the fittest becomes a parent"""
    episodes_for_fitness: int = 1
    """noise-free episodes per individual per generation; fitness is their mean return"""
    rl_injection_interval: int = 1
    """copy the learners' actors over the worst individuals every this many generations"""
    genetic_step: Literal["erl", "mutation-only"] = "erl"
    """erl: ERL's selection, crossover and mutation (SSNE.epoch); mutation-only: EvoRL's simplification"""
    crossover_prob: float = 0.0
    """--genetic-step erl: the chance that two tournament winners are crossed too (ERL's: 0; other slots always are)"""
    mutation_prob: float = 0.9
    """with --genetic-step erl: probability that a non-elite child is mutated (ERL's 0.9; mutation-only mutates all)"""
    mutation_frac: float = 0.1
    """a mutated weight matrix has entries perturbed: with erl a count drawn from [0, ceil(this x entries)), with
    replacement (ERL's); with mutation-only round(this x entries) distinct ones (EvoRL's)"""
    mutation_strength: float = 0.1
    """a normal mutation adds N(0, 1) * |w| * this"""
    super_mutation_prob: float = 0.05
    """probability of a super mutation, adding N(0, 1) * |w| * --super-mutation-strength"""
    super_mutation_strength: float = 10.0
    """the scale of a super mutation"""
    reset_prob: float = 0.05
    """probability that a perturbed entry is reset to N(0, 1)"""
    weight_max_magnitude: float = 1e6
    """mutated weights are clipped to +- this (ERL's 1e6; EvoRL's MuJoCo configs take 10)"""


def make_env(env_id):
    """A training env; one without a time limit gets one of 1,000 steps (MuJoCo's): a fitness needs whole episodes."""
    env = gym.make(env_id)
    return env if env.spec.max_episode_steps else gym.wrappers.TimeLimit(env, 1000)


def to_env(action, low, high):
    """The one place where a normalised action in [-1, 1] becomes the env's action in [low, high]."""
    return low + (action + 1.0) * 0.5 * (high - low)


class Actor(nn.Module):
    """Deterministic policy: 256-256 ReLU MLP with a tanh output in the normalised action space [-1, 1]; `layer_norm`:
    ERL's, LayerNorm then tanh after each hidden layer; the output layer scaled by `init_scale` at initialisation."""

    def __init__(self, obs_dim, act_dim, hidden=256, layer_norm=False, init_scale=1.0):
        super().__init__()

        def hidden_layer(n_in):
            linear = nn.Linear(n_in, hidden)
            return [linear, nn.LayerNorm(hidden), nn.Tanh()] if layer_norm else [linear, nn.ReLU()]

        self.net = nn.Sequential(*hidden_layer(obs_dim), *hidden_layer(hidden), nn.Linear(hidden, act_dim), nn.Tanh())
        for p in self.net[-2].parameters():  # the output layer's weight and bias
            p.data.mul_(init_scale)

    def forward(self, obs):
        return self.net(obs)


class Critic(nn.Module):
    """`num_q` Q-networks (256-256 ReLU MLPs on [obs, action]) with stacked weights, run as one batched matmul; each
    head is initialised like nn.Linear. forward returns Q values of shape (num_q, batch, 1)."""

    def __init__(self, obs_dim, act_dim, hidden=256, num_q=2):
        super().__init__()
        sizes = [obs_dim + act_dim, hidden, hidden, 1]
        bound = [1 / np.sqrt(n_in) for n_in in sizes[:-1]]
        self.weights = nn.ParameterList([nn.Parameter(torch.empty(num_q, n_in, n_out).uniform_(-b, b))
                                         for n_in, n_out, b in zip(sizes, sizes[1:], bound)])
        self.biases = nn.ParameterList([nn.Parameter(torch.empty(num_q, 1, n_out).uniform_(-b, b))
                                        for n_out, b in zip(sizes[1:], bound)])

    def forward(self, obs, action, weights=None, biases=None):
        weights, biases = weights or list(self.weights), biases or list(self.biases)
        x = torch.cat([obs, action], -1).expand(len(weights[0]), -1, -1)
        for i, (w, b) in enumerate(zip(weights, biases)):
            x = torch.baddbmm(b, x, w)
            if i < len(weights) - 1:
                x = torch.relu(x)
        return x

    def fixed(self, obs, action, num_q=None):
        """The first num_q Q values (all by default) with the critic's weights held fixed: gradients reach the
        action, not the critic."""
        return self(obs, action, [w[:num_q].detach() for w in self.weights], [b[:num_q].detach() for b in self.biases])


class ReplayBuffer:
    """Uniform replay in one preallocated float32 tensor on the training device. A row is [obs, action, reward,
    terminated, next_obs], written by slice from one asynchronous upload per vector step. Learner k's batch is
    gathered into `self.batch[k]`, which stays in one place in memory (as a CUDA graph needs); the length is a device
    tensor too, so that sampling never reads a host number. Actions are stored normalised."""

    def __init__(self, capacity, obs_dim, act_dim, batch_size, learners, device):
        self.capacity, self.device, self.pos, self.full = capacity, device, 0, False
        self.split = [obs_dim, act_dim, 1, 1, obs_dim]
        self.data = torch.zeros(capacity, sum(self.split), device=device)
        self.batch = torch.zeros(learners, batch_size, sum(self.split), device=device)
        self.length = torch.zeros((), dtype=torch.int64, device=device)

    def __len__(self):
        return self.capacity if self.full else self.pos

    def add(self, obs, action, reward, terminated, next_obs):
        """Store one row per env that acted."""
        rows = upload(np.concatenate([obs, action, reward[:, None], terminated[:, None], next_obs], 1), self.device)
        first = min(len(rows), self.capacity - self.pos)  # the rows before the ring wraps around
        self.data[self.pos : self.pos + first] = rows[:first]
        self.data[: len(rows) - first] = rows[first:]
        self.full = self.full or self.pos + len(rows) >= self.capacity
        self.pos = (self.pos + len(rows)) % self.capacity
        self.length.fill_(len(self))

    def sample(self, k):
        """obs, action, reward, terminated, next_obs of learner k's uniform batch; reward, terminated: (batch, 1)."""
        idx = torch.randint(0, 2**62, (self.batch.shape[1],), device=self.device) % self.length
        self.batch[k].copy_(self.data[idx])
        return self.batch[k].split(self.split, dim=1)

    def state_dict(self):
        return {"data": self.data[: len(self)].to("cpu", copy=True), "pos": self.pos, "full": self.full}

    def load_state_dict(self, state):
        self.data[: len(state["data"])] = state["data"].to(self.device)
        self.pos, self.full = state["pos"], state["full"]
        self.length.fill_(len(self))


def upload(array, device):
    """A host array as a float32 tensor on `device`, without waiting for a GPU: copied from pinned memory,
    asynchronously (later work on the device is ordered after the copy)."""
    tensor = torch.as_tensor(array, dtype=torch.float32)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


def td_target(reward, terminated, next_q, gamma):
    """y = r + gamma * (1 - terminated) * min_i Q'_i(s', a'): only a true termination stops the bootstrap."""
    return reward + gamma * (1.0 - terminated) * next_q


def soft_update(target, source, tau):
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


def update_critic(rb, learners, actor_targets, qf, qf_target, q_optimizer, args):
    """One step on the twin critics' summed MSE, averaged over the learners that share this critic (a new batch and
    a target policy each: one learner for K pairs, all K with --shared-critic, as EvoRL averages their losses);
    returns each critic's loss (averaged over the learners) and mean Q values."""
    batches = [rb.sample(k) for k in learners]
    actor_targets, losses, qs, head_losses = [actor_targets[k] for k in learners], [], [], []
    for (obs, action, reward, terminated, next_obs), actor_target in zip(batches, actor_targets):
        with torch.no_grad():
            noise = (torch.randn_like(action) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
            next_action = (actor_target(next_obs) + noise).clamp(-1.0, 1.0)
            next_q = qf_target(next_obs, next_action).min(0).values
            target = td_target(reward, terminated, next_q, args.gamma)
        qs.append(qf(obs, action))
        head_losses.append(((qs[-1] - target) ** 2).mean((1, 2)))  # each critic's
        losses.append(head_losses[-1].sum())
    qf_loss = torch.stack(losses).mean()
    q_optimizer.zero_grad(set_to_none=True)
    qf_loss.backward()
    if args.critic_grad_clip:  # ERL's (`core/ddpg.py`)
        nn.utils.clip_grad_norm_(qf.parameters(), args.critic_grad_clip)
    q_optimizer.step()
    return torch.stack(head_losses).mean(0).detach(), torch.cat(qs, 1).detach().mean((1, 2))


def update_actors(rb, learners, actors, qf, actor_targets, qf_target, actor_optimizers, args):
    """The delayed step, on the critic's last batches: each learner's actor ascends Q1 and its target follows, then
    the critic's target. Returns the learners' actor losses."""
    actor_losses = []
    for k in learners:
        obs = rb.batch[k, :, : rb.split[0]]
        actor_loss = -qf.fixed(obs, actors[k](obs), num_q=1)[0].mean()
        actor_optimizers[k].zero_grad(set_to_none=True)
        actor_loss.backward()
        actor_optimizers[k].step()
        actor_losses.append(actor_loss.detach())
        soft_update(actor_targets[k], actors[k], args.tau)
    soft_update(qf_target, qf, args.tau)
    return torch.stack(actor_losses)


def actor_params(actor):
    """An Actor's layers as (weights (n_in, n_out), biases (1, n_out)) lists, the layout of a population; the
    LayerNorms' weights and biases, if any, follow the biases (as in ERL, crossed like biases and never mutated)."""
    layers = [m for m in actor.net if isinstance(m, nn.Linear)]
    norms = [p.detach()[None] for m in actor.net if isinstance(m, nn.LayerNorm) for p in (m.weight, m.bias)]
    return [m.weight.detach().T for m in layers], [m.bias.detach()[None] for m in layers] + norms


def stack_actors(actors):
    """Stacked weights (P, n_in, n_out) and biases (P, 1, n_out) of P actors: a population as a few tensors."""
    weights, biases = zip(*(actor_params(actor) for actor in actors))  # per actor: its layers' lists
    return [torch.stack(w).contiguous() for w in zip(*weights)], [torch.stack(b).contiguous() for b in zip(*biases)]


def individual(weights, biases, i):
    """Individual i of the population as a policy: obs (batch, obs_dim) -> actions."""
    return lambda obs: population_forward([w[i:i + 1] for w in weights], [b[i:i + 1] for b in biases], obs)


def population_forward(weights, biases, obs):
    """Every individual's action for its own observation at once: obs (P, obs_dim) -> actions (P, act_dim), the
    Actor's layers as one batched matmul each."""
    x, norms = obs[:, None, :], biases[len(weights) :]  # --actor-layer-norm: each hidden layer's weight and bias
    for i, (w, b) in enumerate(zip(weights, biases)):
        x = torch.baddbmm(b, x, w)
        if i == len(weights) - 1:
            x = torch.tanh(x)
        elif norms:
            x = torch.tanh(nn.functional.layer_norm(x, x.shape[-1:]) * norms[2 * i] + norms[2 * i + 1])
        else:
            x = torch.relu(x)
    return x[:, 0]


def run_episodes(weights, biases, envs, episodes, noise, device, rb=None, run=None, global_step=0):
    """Run `episodes` full episodes in each of the P envs, env i acting with individual i (plus N(0, noise) if noise
    > 0), all P actions from one batched forward pass per step; transitions go into `rb` once `run` has checked their
    rewards (global_step: the step before the first). Returns each individual's mean return (P) and the steps taken."""
    low, high = envs[0].action_space.low, envs[0].action_space.high
    obs = np.stack([env.reset()[0] for env in envs])
    episode_return, returns = np.zeros(len(envs)), [[] for _ in envs]
    active, steps = np.ones(len(envs), dtype=bool), 0
    while active.any():
        with torch.no_grad():  # inactive envs get an action too: cheaper than gathering the active individuals
            action = population_forward(weights, biases, upload(obs, device))
            if noise > 0:
                action = (action + torch.randn_like(action) * noise).clamp(-1.0, 1.0)
            action = action.cpu().numpy()
        index = np.flatnonzero(active)
        transitions = [envs[i].step(to_env(action[i], low, high)) for i in index]
        next_obs = np.stack([t[0] for t in transitions])  # the true next obs: these envs reset only below
        reward, terminated, truncated = (np.array([t[k] for t in transitions], dtype=np.float64) for k in (1, 2, 3))
        stored_obs, steps = obs[index], steps + len(index)
        if run is not None:
            run.metrics.check_finite(global_step + steps, reward=reward, observation=next_obs)
        obs[index] = next_obs
        episode_return[index] += reward
        for j, i in enumerate(index):
            if terminated[j] or truncated[j]:
                returns[i].append(episode_return[i])
                episode_return[i] = 0.0
                active[i] = len(returns[i]) < episodes
                if active[i]:
                    obs[i] = envs[i].reset()[0]
        if rb is not None:
            rb.add(stored_obs, action[index], reward, terminated, next_obs)
    return np.array([np.mean(r) for r in returns]), steps


def mutate(w, args, rng, fixed_count=False):
    """One 2-D weight matrix's mutation, in place (biases untouched), with probability drawn from U(0, 2) as in both
    codes. ERL's (`core/mod_neuro_evo.py`, SSNE.mutate_inplace): a number of entries drawn uniformly from [0,
    ceil(--mutation-frac x entries)), with replacement, each perturbed in turn (an entry drawn twice is perturbed
    twice) and clipped to +- --weight-max-magnitude. EvoRL's (`evorl/ec/operators/mutation/erl_mutation.py`,
    fixed_count): round(--mutation-frac x entries) distinct entries, then one clip. Each perturbation: a super
    mutation, a reset to N(0, 1), or a normal mutation, by --super-mutation-prob and --reset-prob."""
    if rng.uniform() >= rng.uniform(0.0, 2.0):
        return
    if fixed_count:
        idx = rng.choice(w.numel(), round(args.mutation_frac * w.numel()), replace=False)
    else:
        idx = rng.integers(0, w.numel(), int(rng.integers(0, int(np.ceil(args.mutation_frac * w.numel())))))
    kind, gauss = rng.uniform(size=len(idx)), rng.standard_normal(len(idx))
    # The k-th draw of an entry is applied in round k: each round touches an entry at most once, in the draws' order.
    order = np.argsort(idx, kind="stable")
    first = np.maximum.accumulate(np.where(np.diff(idx[order], prepend=-1) != 0, np.arange(len(idx)), 0))
    rounds = np.empty(len(idx), dtype=np.int64)
    rounds[order] = np.arange(len(idx)) - first
    flat = w.view(-1)
    for r in range(rounds.max() + 1 if len(idx) else 0):
        at = torch.as_tensor(idx[rounds == r], device=w.device)
        k, g = (torch.as_tensor(x[rounds == r], dtype=w.dtype, device=w.device) for x in (kind, gauss))
        old = flat[at]
        new = torch.where(k < args.super_mutation_prob, old + g * old.abs() * args.super_mutation_strength,
                          torch.where(k < args.super_mutation_prob + args.reset_prob, g,
                                      old + g * old.abs() * args.mutation_strength))
        flat[at] = new.clamp(-args.weight_max_magnitude, args.weight_max_magnitude)


def tournament(rank, n, size, rng):
    """`n` winners, each the best of `size` individuals drawn at random (with replacement) from `rank`, best first."""
    return rank[rng.integers(0, len(rank), (n, size)).min(1)]


def crossover(weights, biases, a, b, rng):
    """ERL's crossover of individuals a and b, in place: for each layer, a number of neurons drawn from [0, 2 x
    neurons) (for the biases [0, neurons)) is copied, each from one of the two to the other, the direction drawn
    each time. A neuron's weights are a column of our (n_in, n_out) layout, a row of nn.Linear's (out, in)."""
    for params, times in [(weights, 2), (biases, 1)]:
        for p in params:
            neurons = p.shape[-1]
            n = int(rng.integers(0, times * neurons))
            chosen, a_receives = rng.integers(0, neurons, n), rng.uniform(size=n) < 0.5
            # After the first copy of a neuron both individuals hold the same one: only the first copy counts.
            first = np.unique(chosen, return_index=True)[1]
            for receives, giver in [(True, b), (False, a)]:
                cols = torch.as_tensor(chosen[first][a_receives[first] == receives], device=p.device)
                p[a if receives else b][..., cols] = p[giver][..., cols]


def next_generation(weights, biases, fitness, args, rng, learners=0):
    """ERL's genetic step (SSNE.epoch), in place: the --num-elites best are copied into slots of their own and
    spared mutation; tournaments pick --pop-size minus --num-elites winners (duplicates removed), which keep their
    slots; every other slot becomes a copy of a random elite or of a random winner, crossed pairwise, always; pairs
    of winners are crossed with --crossover-prob; all but the elites' copies are mutated with --mutation-prob
    (ERL's mutation). Returns the slots of the elites' copies (the champion's first), the old population's elites
    and winners, and the slots of the `learners` copies of the learners: ERL's rule (`run_erl.py`), the worst by the
    fitness before the step, whatever the step put there (an elite's copy too; docs/erl_td3.md says why)."""
    learner_slots = np.argsort(fitness, kind="stable")[:learners].tolist()  # ERL's: the worst before the step
    rank = np.argsort(-fitness, kind="stable")
    elites = rank[: args.num_elites]
    winners = list(dict.fromkeys(tournament(rank, len(rank) - args.num_elites, args.tournament_size, rng).tolist()))
    if len(winners) % 2:
        winners.append(winners[rng.integers(len(winners))])
    selected, copies = np.array(winners), []
    others = [i for i in range(len(rank)) if i not in winners and i not in elites]
    others = [others[i] for i in rng.permutation(len(others))]
    for e in elites:  # into an unselected slot if one is left, else into a winner's
        slot = others.pop(0) if others else winners.pop(0)
        for p in weights + biases:
            p[slot] = p[e]
        copies.append(slot)
    if len(others) % 2:
        others.append(others[rng.integers(len(others))])
    for a, b in zip(others[0::2], others[1::2]):
        for slot, source in [(a, copies[rng.integers(len(copies))]), (b, winners[rng.integers(len(winners))])]:
            for p in weights + biases:
                p[slot] = p[source]
        crossover(weights, biases, a, b, rng)
    for a, b in zip(winners[0::2], winners[1::2]):
        if rng.uniform() < args.crossover_prob:
            crossover(weights, biases, a, b, rng)
    for i in range(len(rank)):
        if i not in copies and rng.uniform() < args.mutation_prob:
            for w in weights:
                mutate(w[i], args, rng)
    return np.array(copies), elites, selected, learner_slots


def next_generation_mutation_only(weights, biases, fitness, args, rng, learners=0):
    """EvoRL's mutation-only step (`evorl/ec/optimizers/erl_ga.py`, ERLGAMod.tell_external without crossover), in
    place: the --num-elites best stay in their slots; the `learners` worst are left out of parent selection and keep
    their slots for the learners' copies; every other slot becomes a copy of a tournament winner among the rest, always
    mutated with EvoRL's fixed count. Returns what next_generation returns."""
    rank = np.argsort(-fitness, kind="stable")
    parents, learner_slots = rank[: len(rank) - learners], rank[len(rank) - learners :]
    elites, others = rank[: args.num_elites], np.sort(parents[args.num_elites :])
    winners = tournament(parents, len(others), args.tournament_size, rng)
    for p in weights + biases:
        p[others] = p[winners].clone()
    for i in others:
        for w in weights:
            mutate(w[i], args, rng, fixed_count=True)
    return elites, elites, winners, learner_slots.tolist()


def saturation(actor, rb):
    """The share of `actor`'s actions within 0.01 of a bound, on the states of learner 0's last batch (no new
    draw; all zeros before the first update): near 1, its tanh is saturated and its gradient vanishes."""
    with torch.no_grad():
        return float((actor(rb.batch[0, :, : rb.split[0]]).abs() > 0.99).float().mean())


def inject(weights, biases, slots, actors):
    """Copy the learners' actors into the population's `slots` (none: no injection)."""
    if slots:
        learner_weights, learner_biases = stack_actors(actors)
        for p, q in zip(weights + biases, learner_weights + learner_biases):
            p[slots] = q


def log_generation(run, global_step, generation, fitness, fates, learner_returns, saturation):
    """At a generation's end: metrics, fitness, injections' fates, learner returns, saturation, best return yet."""
    writer, run.best_return = run.metrics.writer, max(run.best_return, *fitness, *learner_returns)
    writer.add_scalar("charts/best_return", run.best_return, global_step)
    if run.metrics.count:  # (a generation with updates: the learner's batch is from the buffer)
        writer.add_scalar("charts/learner_saturation", saturation, global_step)
    run.metrics.log(global_step)
    for statistic in ("max", "mean", "min"):
        writer.add_scalar(f"evolution/fitness_{statistic}", getattr(fitness, statistic)(), global_step)
    writer.add_scalar("evolution/generation", generation, global_step)
    for fate, count in fates.items():  # the "RL selection rate": elite + selected over all injections
        writer.add_scalar(f"evolution/injected_{fate}", count / max(sum(fates.values()), 1), global_step)
    for k, episode_return in enumerate(learner_returns):  # learner 0's under CleanRL's name
        writer.add_scalar("charts/episodic_return" + (f"_{k}" if k else ""), episode_return, global_step)


def crossed(step, freq, step_size):
    """True when the last step_size steps, ending at step, crossed a multiple of freq (never when freq is 0)."""
    return freq > 0 and step // freq != (step - step_size) // freq


def main(args):
    check_args(args)
    checkpoint = args.resume and read_checkpoint(args.resume, args)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)  # the genetic algorithm's draws

    learner_envs = [make_env(args.env_id) for _ in range(args.num_rl_agents)]
    obs_dim, act_dim = learner_envs[0].observation_space.shape[0], learner_envs[0].action_space.shape[0]
    num_critics = 1 if args.shared_critic else args.num_rl_agents
    device = choose_device(args, (args.buffer_size + args.batch_size * args.num_rl_agents)
                           * (2 * obs_dim + act_dim + 2) * 4)  # the replay's rows, and a batch for each learner
    # One env per individual and one per learner, each seeded once; after that their episodes follow their RNGs.
    envs = [make_env(args.env_id) for _ in range(args.pop_size)]
    for i, env in enumerate(envs + learner_envs):
        env.reset(seed=args.seed + i)

    actor = partial(Actor, obs_dim, act_dim, args.actor_hidden, args.actor_layer_norm)
    weights, biases = stack_actors([actor().to(device) for _ in range(args.pop_size)])
    actors = [actor(init_scale=args.learner_init_scale).to(device) for _ in range(args.num_rl_agents)]
    actor_targets = [actor().to(device) for _ in range(args.num_rl_agents)]
    qfs = [Critic(obs_dim, act_dim).to(device) for _ in range(num_critics)]
    qf_targets = [Critic(obs_dim, act_dim).to(device) for _ in qfs]
    for target, source in zip(actor_targets + qf_targets, actors + qfs):
        target.load_state_dict(source.state_dict())
    # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
    adam = partial(torch.optim.Adam, fused=True, capturable=args.cudagraphs)
    actor_optimizers = [adam(a.parameters(), lr=args.actor_lr or args.learning_rate) for a in actors]
    q_optimizers = [adam(q.parameters(), lr=args.critic_lr or args.learning_rate) for q in qfs]
    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, args.batch_size, args.num_rl_agents, device)
    # Each critic's learners (K actor-critic pairs, or K actors and one shared critic), and its updates as callables.
    critic_learners = [list(range(args.num_rl_agents))] if args.shared_critic else [[k] for k in range(len(qfs))]
    critic_steps = [accelerate(partial(update_critic, rb, learners, actor_targets, qfs[q], qf_targets[q],
                                       q_optimizers[q], args), args) for q, learners in enumerate(critic_learners)]
    actor_steps = [accelerate(partial(update_actors, rb, learners, actors, qfs[q], actor_targets, qf_targets[q],
                                      actor_optimizers, args), args) for q, learners in enumerate(critic_learners)]
    # Everything a checkpoint holds besides the loop's counters and the envs: --resume restores exactly these.
    state = {"rb": rb, "rng": rng, "population": nn.ParameterList(weights + biases), **{  # (shares their memory)
        f"{name}_{k}": value for name, group in [("actor", actors), ("actor_target", actor_targets), ("qf", qfs),
        ("actor_optimizer", actor_optimizers), ("qf_target", qf_targets), ("q_optimizer", q_optimizers)]
        for k, value in enumerate(group)}}

    # injected: the learners' slots, filled at the next generation's start. A signal's checkpoint keeps a generation's
    # updates still due (with its steps and learner returns): the resumed run makes them before the genetic step.
    start = {"global_step": 0, "num_updates": 0, "generation": 0, "fitness": np.zeros(args.pop_size), "injected": [],
             "fates": {"elite": 0, "selected": 0, "discarded": 0}, "champion": 0, "updates_due": 0,
             "generation_steps": 0, "learner_returns": np.zeros(args.num_rl_agents),
             "actor_losses": [torch.zeros(len(learners)) for learners in critic_learners]}  # the last: delayed updates
    loop = restore(checkpoint, state, envs + learner_envs, start) if checkpoint else start
    global_step, num_updates, generation, fitness, injected, fates, champion, updates_due, generation_steps = (
        loop[name] for name in ("global_step", "num_updates", "generation", "fitness", "injected", "fates",
                                "champion", "updates_due", "generation_steps"))
    learner_returns, actor_losses = loop["learner_returns"], [losses.to(device) for losses in loop["actor_losses"]]
    run = Run(args, checkpoint, device)
    try:
        if run.evaluation_due:  # the checkpoint's evaluation, which a signal interrupted
            run.evaluate_and_log(global_step, individual(weights, biases, champion), actors[0])
            run.exit_on_signal(global_step, updates_due)  # the checkpoint resumed from still holds it all
        while global_step < args.total_timesteps or updates_due:
            if not updates_due:  # (else the updates of a generation that a signal interrupted come first)
                inject(weights, biases, injected, actors)  # 5. of the last generation: the learners' copies
                # 1. Fitness: every individual's episodes at once, without noise. 2. The learners' noisy episodes.
                fitness, population_steps = run_episodes(weights, biases, envs, args.episodes_for_fitness, 0.0,
                                                         device, rb, run, global_step)
                learner_returns, learner_steps = run_episodes(*stack_actors(actors), learner_envs, 1,
                                                              args.exploration_noise, device, rb, run,
                                                              global_step + population_steps)
                generation_steps = population_steps + learner_steps
                global_step += generation_steps
                if not np.isfinite(fitness).all():
                    run.stop_on(f"non-finite fitness in generation {generation}, at global_step {global_step}")
                updates_due = int(args.utd_ratio * generation_steps) if len(rb) > args.learning_starts else 0

            # 3. TD3 updates, --utd-ratio per env step of this generation, for each critic and its learners.
            while updates_due and not run.signal:
                for q in range(len(critic_learners)):
                    qf_losses, qf_values = critic_steps[q]()
                    if num_updates % args.policy_frequency == 0:
                        actor_losses[q] = actor_steps[q]()
                    run.metrics.record(global_step, num_updates + 1, qf_loss=qf_losses.mean(), qf1_loss=qf_losses[0],
                                       qf2_loss=qf_losses[1], actor_loss=actor_losses[q].mean(),
                                       qf1_values=qf_values[0], qf2_values=qf_values[1])
                num_updates, updates_due = num_updates + 1, updates_due - 1

            if not updates_due:  # (else a signal stopped the updates: the checkpoint below keeps the generation)
                # 4. The genetic step, which also chooses the slots of the learners' copies when they are due
                # (once the learners have trained); the fate of the copies injected at this generation's start.
                injecting = (generation + 1) % args.rl_injection_interval == 0 and num_updates > 0
                genetic_step = next_generation if args.genetic_step == "erl" else next_generation_mutation_only
                copies, elites, selected, slots = genetic_step(weights, biases, fitness, args, rng,
                                                               args.num_rl_agents if injecting else 0)
                for slot in injected:
                    fates["elite" if slot in elites else "selected" if slot in selected else "discarded"] += 1
                champion, generation, injected = int(copies[0]), generation + 1, slots
                log_generation(run, global_step, generation, fitness, fates, learner_returns, saturation(actors[0], rb))
                run.progress.update(global_step, num_updates)
                if crossed(global_step, args.eval_freq, generation_steps) or global_step >= args.total_timesteps:
                    run.evaluate_and_log(global_step, individual(weights, biases, champion), actors[0])
            done = global_step >= args.total_timesteps and not updates_due
            if run.signal or (done and args.checkpoint_freq) or crossed(global_step, args.checkpoint_freq,
                                                                         generation_steps):
                run.save_checkpoint(state, envs + learner_envs, global_step=global_step, num_updates=num_updates,
                                    generation=generation, fitness=fitness, injected=injected, fates=fates,
                                    champion=champion, updates_due=updates_due, generation_steps=generation_steps,
                                    learner_returns=learner_returns, actor_losses=actor_losses)
                run.exit_on_signal(global_step, updates_due)
        if args.save_model:  # the final networks and the population, on the CPU, and the arguments
            model = {f"{name}_{k}": net.cpu().state_dict() for name, nets in [("actor", actors), ("qf", qfs)]
                     for k, net in enumerate(nets)}
            model["population"] = {"weights": [w.cpu() for w in weights], "biases": [b.cpu() for b in biases],
                                   "fitness": fitness}
            write_atomically(f"{run.dir}/model.pt", partial(torch.save, {**model, "args": asdict(args)}), mode="wb")
        run.finished = True
    finally:
        for env in envs + learner_envs:
            env.close()
        run.close()
    return run.result


# ======================================================================================================================
# Part 2: the run machinery. Nothing below changes what is computed: it checks the input before anything is written,
# owns the run's directory (one writer, files written whole), evaluates, and stops on a non-finite number or a signal.
# ======================================================================================================================

# Flags a resume may change: they change how a run is watched, not what it computes.
WATCH_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video"}
WATCH_FLAGS |= {"save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda"}
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
    positive = ["total_timesteps", "num_envs", "buffer_size", "batch_size", "eval_episodes", "log_freq", "tau"]
    positive += ["policy_frequency", "learning_rate"]
    positive += ["num_rl_agents", "pop_size", "num_elites", "tournament_size", "episodes_for_fitness"]  # ERL's too
    positive += ["rl_injection_interval", "weight_max_magnitude", "actor_hidden", "learner_init_scale"]
    unit_interval = ["crossover_prob", "mutation_prob", "mutation_frac", "super_mutation_prob", "reset_prob"]  # ERL's
    for name, value in asdict(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not np.isfinite(value):
            fail(f"{flag} must be a finite number, got {value}")
        if isinstance(value, (int, float)) and (value <= 0 if name in positive else value < 0):
            fail(f"{flag} must be {'positive' if name in positive else 'non-negative'}, got {value}")
        if name in ["gamma", "tau", *unit_interval] and not 0 <= value <= 1:
            fail(f"{flag} must lie in [0, 1], got {value}")
    # An --env-id without a version: gymnasium would run the latest silently, in a directory not saying which.
    versions = sorted(i for i in gym.registry if i.rsplit("-v", 1)[0] == args.env_id)
    problems = {
        f"--env-id {args.env_id} names no version; gymnasium has {', '.join(versions)}": bool(versions),
        f"--seed must lie in [0, 2**31), got {args.seed}": not 0 <= args.seed < 2**31,
        "--eval-episodes must be at most 1000": args.eval_episodes > 1000,
        f"--batch-size {args.batch_size} is larger than --buffer-size": args.batch_size > args.buffer_size,
        "--learning-starts must be below --total-timesteps": args.learning_starts >= args.total_timesteps,
        "--learning-starts must be below --buffer-size": args.learning_starts >= args.buffer_size,  # ERL's rules
        "--num-elites plus --num-rl-agents exceed --pop-size": args.num_elites + args.num_rl_agents > args.pop_size,
        f"--exp-name {args.exp_name!r} must be a plain file name of 1-100 characters": not (
            0 < len(args.exp_name) <= 100 and "/" not in args.exp_name and not args.exp_name.startswith(".")),
        "--resume needs the path of a checkpoint.pt": args.resume == "",
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
        fail(f"{args.env_id} has a {type(act_space).__name__} action space; TD3 needs a Box, see sac_discrete.py")
    if len(act_space.shape) != 1 or not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        fail(f"{args.env_id} has actions {act_space}; TD3's tanh policy needs a bounded Box of one dimension")
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
    unfinished = checkpoint["run"]["evaluation_due"] or checkpoint["loop"]["updates_due"]  # ERL's generation's
    if args and args.total_timesteps <= step and not unfinished:  # updates can end a run
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
    torch._dynamo.config.cache_size_limit += 1  # ERL: a compile per learner of one function; past 8 dynamo runs eagerly
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
        """Add one update's metrics (scalar tensors, on the device); ERL logs them at a generation's end."""
        self.sps_start = self.sps_start or (global_step, time.time())
        self.names, self.sum = list(metrics), torch.stack(list(metrics.values())) + (self.sum if self.count else 0)
        self.window = [update, global_step] * 2 if not self.count else self.window[:2] + [update, global_step]
        self.count += 1

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
        self.best_return = saved.get("best_return", -np.inf)  # ERL: the best fitness or learner return yet
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

    def evaluate_and_log(self, global_step, policy, learner_policy):  # ERL: the champion; the first learner beside
        """Evaluate `policy` into evaluations.csv and TensorBoard; a signal ends it at once, leaving it due."""
        self.metrics.log(global_step)
        self.evaluation_due = True
        video_folder = os.path.join("videos", os.path.basename(self.dir)) if self.args.capture_video else None
        returns = evaluate(policy, self.args.env_id, self.args.eval_episodes, self.args.seed + 100_000, self.device,
                           lambda: self.signal, video_folder, video_prefix=f"step-{global_step}")
        learner_returns = returns and evaluate(learner_policy, self.args.env_id, self.args.eval_episodes,
                                               self.args.seed + 100_000, self.device, lambda: self.signal)  # ERL
        if learner_returns is None:
            return
        mean, std, self.evaluation_due = float(np.mean(returns)), float(np.std(returns)), False
        self.metrics.writer.add_scalar("eval/episodic_return", mean, global_step)
        learner = [float(np.mean(learner_returns)), float(np.std(learner_returns))]  # ERL
        self.metrics.writer.add_scalar("eval/learner_episodic_return", learner[0], global_step)  # ERL
        wall_time = round(time.time() - self.start_time, 1)
        self.evaluations.append([global_step, wall_time, mean, std, " ".join(f"{r:.2f}" for r in returns)])
        self.evaluations[-1] += learner  # ERL
        self.write_evaluations()
        self.result = {"run_dir": self.dir, "global_step": global_step, "eval_mean": mean, "eval_std": std}
        self.result["learner_eval_mean"] = learner[0]  # ERL
        self.progress.last_eval = f"{mean:.1f} +- {std:.1f}"
        self.progress.say(f"step {global_step}/{self.args.total_timesteps} | eval return {self.progress.last_eval}")

    def write_evaluations(self):
        rows = [["global_step", "wall_time_s", "mean_return", "std_return", "returns"], *self.evaluations]
        rows[0] += ["learner_mean_return", "learner_std_return"]  # ERL: the learner's columns
        write_atomically(f"{self.dir}/evaluations.csv", lambda f: csv.writer(f).writerows(rows))

    def save_checkpoint(self, state, envs, **loop):
        """Write `state`, the envs, every RNG, the loop's values by name, the evaluations and metrics (checked)."""
        self.metrics.means()
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        metrics = {k: getattr(self.metrics, k) for k in ("names", "sum", "count", "window")}  # as Metrics takes them
        run = {"wall_time": time.time() - self.start_time, "evaluations": self.evaluations,
               "evaluation_due": self.evaluation_due, "metrics": metrics}
        run["best_return"] = self.best_return  # ERL
        state = {k: v.bit_generator.state if hasattr(v, "bit_generator") else v.state_dict() for k, v in state.items()}
        checkpoint = {"script": os.path.basename(__file__), "args": asdict(self.args), "loop": loop, "run": run,
                      "state": state, "envs": [env_state(env) for env in envs], "rng": rng}
        write_atomically(f"{self.dir}/checkpoint.pt", partial(torch.save, checkpoint), mode="wb")

    def exit_on_signal(self, global_step, updates_due):
        """After a signal a run with steps (ERL's: or a generation's updates) left ends here: one line, 128 + signal."""
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
    try:
        main(args)
    except RuntimeError as e:  # an allocation the memory check let through (CUDA's OutOfMemoryError is one too)
        if "alloc" not in str(e):
            raise
        fail("out of memory (lower --buffer-size or --batch-size)", e)
