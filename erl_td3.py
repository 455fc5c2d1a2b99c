"""ERL-TD3: Evolutionary Reinforcement Learning with TD3 learners, in one file.

Paper: Khadka, Tumer, "Evolution-Guided Policy Gradient in Reinforcement Learning", NeurIPS 2018,
https://arxiv.org/abs/1805.07917 (with DDPG); TD3 learners and the generation order as in EvoRL's ERL workflow.
A population of deterministic actors is evolved by a genetic algorithm beside K TD3 learners; all of them fill
one replay buffer, and copies of the learners' actors replace the worst individuals every
--rl-injection-interval generations. One generation:
  1. fitness: every individual runs --episodes-for-fitness episodes without noise (all at once: one env per
     individual, one batched forward pass of the stacked population per step); fitness = mean return;
  2. each learner runs one episode with N(0, --exploration-noise) noise;
  3. TD3 updates: --utd-ratio critic updates per env step of this generation for each learner, the actor and
     the targets every --policy-frequency-th (none before --learning-starts env steps are stored);
  4. the genetic step: the --num-elites best are kept unchanged; the other slots are filled by tournament
     selection (size --tournament-size, over the whole population), optional crossover, and ERL's mutation;
  5. injection of the learners' actors into the worst slots; their fate (elite, selected as a parent, or
     discarded) is decided by the next generation's genetic step and logged.
Learner layouts: K (actor, critic) pairs (ERL, the default), or --shared-critic: K actors and one critic
(CEM-RL style), which then takes one update against each learner's target policy per update step.
Deliberate choices and differences:
- global_step and --total-timesteps count every env step, population and learners alike. Runs end, evaluate and
  checkpoint at generation boundaries (a run stops at the end of the generation that reaches the total);
  SIGINT/SIGTERM are handled at the end of the current generation.
- No uniform random phase: before --learning-starts the untrained learners act with noise, the population explores.
- Evaluation (deterministic): the champion, best by its last fitness, in the common evaluations.csv columns; the
  first learner in extra ones. Networks, normalised actions and the TD3 update are td3_continuous.py's.
"""
import csv
import json
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
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
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """use the GPU if there is one"""
    torch_threads: int = 0
    """CPU threads for torch; 0 keeps torch's default (one per core)"""
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
    learning_starts: int = 25000
    """environment steps stored before the learners' updates start"""
    buffer_size: int = 1000000
    """the replay memory size"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    gamma: float = 0.99
    """the discount factor gamma"""
    eval_freq: int = 5000
    """deterministic evaluation at the end of each generation that crosses a multiple of this many env steps
    (0: only the final evaluation)"""
    eval_episodes: int = 10
    """episodes per evaluation"""
    checkpoint_freq: int = 100000
    """write runs/{run_name}/checkpoint.pt every this many env steps and at the end (0: never)"""
    resume: Optional[str] = None
    """path of a checkpoint.pt to continue from (the run keeps its directory)"""
    log_freq: int = 100
    """unused here: ERL logs losses, and checks them for NaN, once per generation (kept for the common flags)"""

    # Algorithm specific arguments
    learning_rate: float = 3e-4
    """the learning rate of the actor and critic optimizers"""
    tau: float = 0.005
    """target network smoothing coefficient"""
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
    """the best individuals carried unchanged into the next generation"""
    tournament_size: int = 3
    """individuals drawn per tournament; the fittest becomes a parent"""
    episodes_for_fitness: int = 1
    """noise-free episodes per individual per generation; fitness is their mean return"""
    rl_injection_interval: int = 1
    """copy the learners' actors over the worst individuals every this many generations"""
    crossover_prob: float = 0.0
    """probability that two consecutive children swap a random half of their weight rows (ERL's MuJoCo setting: 0)"""
    mutation_prob: float = 0.9
    """probability that a non-elite child is mutated (ERL: 0.9; EvoRL: 1.0)"""
    mutation_frac: float = 0.1
    """fraction of the entries of a mutated weight matrix that are perturbed"""
    mutation_strength: float = 0.1
    """a normal mutation adds N(0, 1) * |w| * this"""
    super_mutation_prob: float = 0.05
    """probability of a super mutation, adding N(0, 1) * |w| * --super-mutation-strength"""
    super_mutation_strength: float = 10.0
    """the scale of a super mutation"""
    reset_prob: float = 0.05
    """probability that a perturbed entry is reset to N(0, 1)"""
    weight_max_magnitude: float = 10.0
    """weights are clipped to +- this after mutation (EvoRL's MuJoCo setting; ERL: 1e6)"""


# Flags that may differ when resuming: they change how a run is watched, not what it computes.
RESUMABLE_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video",
                   "save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda"}


def fail(message):
    """Stop with one line on stderr and exit status 1: the form of every user error."""
    sys.exit(f"error: {message}")


def check_args(args):
    for name in ["total_timesteps", "buffer_size", "batch_size", "eval_episodes", "log_freq", "policy_frequency",
                 "learning_rate", "tau", "num_rl_agents", "pop_size", "tournament_size", "episodes_for_fitness",
                 "rl_injection_interval", "weight_max_magnitude"]:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["learning_starts", "eval_freq", "checkpoint_freq", "torch_threads", "policy_noise", "noise_clip",
                 "exploration_noise", "utd_ratio", "num_elites", "mutation_strength", "super_mutation_strength"]:
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if not 0 <= args.gamma <= 1 or args.tau > 1:
        fail(f"--gamma and --tau must lie in [0, 1], got {args.gamma} and {args.tau}")
    for name in ["crossover_prob", "mutation_prob", "mutation_frac", "super_mutation_prob", "reset_prob"]:
        if not 0 <= getattr(args, name) <= 1:
            fail(f"--{name.replace('_', '-')} must lie in [0, 1], got {getattr(args, name)}")
    if args.num_elites + args.num_rl_agents > args.pop_size:
        fail(f"--num-elites {args.num_elites} plus --num-rl-agents {args.num_rl_agents} exceed --pop-size "
             f"{args.pop_size}: injected actors would replace elites")
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}")


def make_env(env_id):
    return lambda: gym.make(env_id)


def check_env(env_id):
    """Fail with one line unless env_id names an env this script can learn: vector observations, bounded actions."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises many kinds: unknown id, missing extra, bad module path
        fail(f"cannot make --env-id {env_id!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Box):
        fail(f"{env_id} has a {type(act_space).__name__} action space; ERL-TD3 needs a continuous (Box) one, "
             "see sac_discrete.py")
    if not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        fail(f"{env_id} has unbounded actions; the tanh policy needs finite bounds")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        fail(f"{env_id} has {obs_space} observations; this script needs a flat vector (Box of one dimension)")


def to_env(action, low, high):
    """The one place where a normalised action in [-1, 1] becomes the env's action in [low, high]."""
    return low + (action + 1.0) * 0.5 * (high - low)


class Actor(nn.Module):
    """Deterministic policy: 256-256 ReLU MLP with a tanh output in the normalised action space [-1, 1]."""

    def __init__(self, obs_dim, act_dim, hidden=256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, act_dim), nn.Tanh())

    def forward(self, obs):
        return self.net(obs)


class Critic(nn.Module):
    """`num_q` Q-networks (256-256 ReLU MLPs on [obs, action]) with stacked weights, run as one batched matmul.

    Each head is initialised like nn.Linear. forward returns Q values of shape (num_q, batch, 1).
    """

    def __init__(self, obs_dim, act_dim, hidden=256, num_q=2):
        super().__init__()
        sizes = [obs_dim + act_dim, hidden, hidden, 1]
        bound = [1 / np.sqrt(n_in) for n_in in sizes[:-1]]
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.empty(num_q, n_in, n_out).uniform_(-b, b)) for n_in, n_out, b in zip(sizes, sizes[1:], bound)])
        self.biases = nn.ParameterList(
            [nn.Parameter(torch.empty(num_q, 1, n_out).uniform_(-b, b)) for n_out, b in zip(sizes[1:], bound)])

    def forward(self, obs, action, weights=None, biases=None):
        weights, biases = weights or list(self.weights), biases or list(self.biases)
        x = torch.cat([obs, action], -1).expand(len(weights[0]), -1, -1)
        for i, (w, b) in enumerate(zip(weights, biases)):
            x = torch.baddbmm(b, x, w)
            if i < len(weights) - 1:
                x = torch.relu(x)
        return x

    def q1_fixed(self, obs, action):
        """Q1 with the critic's weights held fixed: gradients reach the action, not the critic."""
        return self(obs, action, [w[:1].detach() for w in self.weights], [b[:1].detach() for b in self.biases])[0]


class ReplayBuffer:
    """Uniform replay in one preallocated float32 tensor on the training device.

    A row is [obs, action, reward, terminated, next_obs]: one host-to-device copy per vector step, one
    gather per batch. Actions are stored normalised, in [-1, 1].
    """

    def __init__(self, capacity, obs_dim, act_dim, device):
        self.capacity, self.device, self.pos, self.full = capacity, device, 0, False
        self.split = [obs_dim, act_dim, 1, 1, obs_dim]
        self.data = torch.zeros(capacity, sum(self.split), device=device)

    def __len__(self):
        return self.capacity if self.full else self.pos

    def add(self, obs, action, reward, terminated, next_obs):
        rows = np.concatenate([obs, action, reward[:, None], terminated[:, None], next_obs], 1, dtype=np.float32)
        idx = (self.pos + np.arange(len(rows))) % self.capacity
        self.data[torch.from_numpy(idx).to(self.device)] = torch.from_numpy(rows).to(self.device)
        self.full = self.full or self.pos + len(rows) >= self.capacity
        self.pos = (self.pos + len(rows)) % self.capacity

    def sample(self, batch_size):
        """obs, action, reward, terminated, next_obs; reward and terminated of shape (batch, 1)."""
        idx = torch.randint(0, len(self), (batch_size,), device=self.device)
        return self.data[idx].split(self.split, dim=1)

    def state_dict(self):
        return {"data": self.data[: len(self)].cpu(), "pos": self.pos, "full": self.full}

    def load_state_dict(self, state):
        self.data[: len(state["data"])] = state["data"].to(self.device)
        self.pos, self.full = state["pos"], state["full"]


def td3_target(reward, terminated, next_q, gamma):
    """y = r + gamma * (1 - terminated) * min_i Q'_i(s', a'): only a true termination stops the bootstrap."""
    return reward + gamma * (1.0 - terminated) * next_q


def soft_update(target, source, tau):
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


def update_critic(batch, actor_target, qf, qf_target, q_optimizer, args):
    obs, action, reward, terminated, next_obs = batch
    with torch.no_grad():
        noise = (torch.randn_like(action) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
        next_action = (actor_target(next_obs) + noise).clamp(-1.0, 1.0)
        next_q = qf_target(next_obs, next_action).min(0).values
        target = td3_target(reward, terminated, next_q, args.gamma)
    q = qf(obs, action)
    qf_loss = ((q - target) ** 2).mean((1, 2)).sum()  # the sum of the twin critics' MSE losses
    q_optimizer.zero_grad(set_to_none=True)
    qf_loss.backward()
    q_optimizer.step()
    return qf_loss.detach(), q.detach().mean((1, 2))


def update_actor(obs, actor, qf, actor_optimizer):
    actor_loss = -qf.q1_fixed(obs, actor(obs)).mean()
    actor_optimizer.zero_grad(set_to_none=True)
    actor_loss.backward()
    actor_optimizer.step()
    return actor_loss.detach()


def actor_params(actor):
    """An Actor's layers as (weights (n_in, n_out), biases (1, n_out)) lists, the layout of a population."""
    layers = [m for m in actor.net if isinstance(m, nn.Linear)]
    return [m.weight.detach().T for m in layers], [m.bias.detach()[None] for m in layers]


def stack_actors(actors):
    """Stacked weights (P, n_in, n_out) and biases (P, 1, n_out) of P actors: a population as a few tensors."""
    params = [actor_params(actor) for actor in actors]
    return ([torch.stack(ws).contiguous() for ws in zip(*(p[0] for p in params))],
            [torch.stack(bs).contiguous() for bs in zip(*(p[1] for p in params))])


def population_forward(weights, biases, obs):
    """Every individual's action for its own observation at once: obs (P, obs_dim) -> actions (P, act_dim), the
    Actor's layers as one batched matmul each."""
    x = obs[:, None, :]
    for i, (w, b) in enumerate(zip(weights, biases)):
        x = torch.baddbmm(b, x, w)
        x = torch.relu(x) if i < len(weights) - 1 else torch.tanh(x)
    return x[:, 0]


def run_episodes(weights, biases, envs, episodes, noise, device, rb=None):
    """Run `episodes` full episodes in each of the P envs, env i acting with individual i (plus N(0, noise) when
    noise > 0), all P actions from one batched forward pass per step. Transitions go into `rb`. Returns the mean
    return per individual (an array of P) and the number of env steps taken."""
    low, high = envs[0].action_space.low, envs[0].action_space.high
    obs = np.stack([env.reset()[0] for env in envs])
    episode_return, returns = np.zeros(len(envs)), [[] for _ in envs]
    active, steps = np.ones(len(envs), dtype=bool), 0
    while active.any():
        with torch.no_grad():  # inactive envs get an action too: cheaper than gathering the active individuals
            action = population_forward(weights, biases, torch.as_tensor(obs, dtype=torch.float32, device=device))
            if noise > 0:
                action = (action + torch.randn_like(action) * noise).clamp(-1.0, 1.0)
            action = action.cpu().numpy()
        index = np.flatnonzero(active)
        transitions = [envs[i].step(to_env(action[i], low, high)) for i in index]
        next_obs = np.stack([t[0] for t in transitions])  # the true next obs: these envs reset only below
        reward, terminated, truncated = (np.array([t[k] for t in transitions], dtype=np.float64) for k in (1, 2, 3))
        if rb is not None:
            rb.add(obs[index], action[index], reward, terminated, next_obs)
        steps += len(index)
        obs[index] = next_obs
        episode_return[index] += reward
        for j, i in enumerate(index):
            if terminated[j] or truncated[j]:
                returns[i].append(episode_return[i])
                episode_return[i] = 0.0
                if len(returns[i]) < episodes:
                    obs[i] = envs[i].reset()[0]
                else:
                    active[i] = False
    return np.array([np.mean(r) for r in returns]), steps


def mutate(w, args, rng):
    """ERL's mutation of one 2-D weight matrix, in place: with probability drawn from U(0, 2), perturb about
    --mutation-frac of its entries (super mutation, reset, or normal mutation), then clip."""
    if rng.uniform() >= rng.uniform(0.0, 2.0):
        return
    n = int(np.ceil(args.mutation_frac * w.numel()))
    idx = torch.as_tensor(rng.integers(0, w.numel(), n), device=w.device)
    kind = torch.as_tensor(rng.uniform(size=n), dtype=w.dtype, device=w.device)
    flat = w.view(-1)
    old = flat[idx]
    gauss = torch.as_tensor(rng.standard_normal(n), dtype=w.dtype, device=w.device)
    new = torch.where(kind < args.super_mutation_prob, old + gauss * old.abs() * args.super_mutation_strength,
                      torch.where(kind < args.super_mutation_prob + args.reset_prob, gauss,
                                  old + gauss * old.abs() * args.mutation_strength))
    flat[idx] = new.clamp(-args.weight_max_magnitude, args.weight_max_magnitude)


def tournament(fitness, n, size, rng):
    """`n` parents, each the fittest of `size` individuals drawn at random (with replacement)."""
    draws = rng.integers(0, len(fitness), (n, size))
    return draws[np.arange(n), np.argmax(fitness[draws], axis=1)]


def next_generation(weights, biases, fitness, args, rng):
    """The genetic step, in place: the --num-elites best stay as they are in their slots; every other slot gets a
    clone of a tournament winner, then optional crossover and mutation (2-D weights only, biases untouched).
    Returns the elites' and the parents' indices in the old population."""
    order = np.argsort(-fitness, kind="stable")
    elites, others = order[: args.num_elites], np.sort(order[args.num_elites:])
    parents = tournament(fitness, len(others), args.tournament_size, rng)
    for p in weights + biases:
        p[others] = p[parents].clone()
    for a, b in zip(others[0::2], others[1::2]):
        if rng.uniform() < args.crossover_prob:
            for w in weights:  # swap a random half of the rows (the inputs' weights) between the two children
                rows = torch.as_tensor(rng.uniform(size=w.shape[1]) < 0.5, device=w.device)
                w[a, rows], w[b, rows] = w[b, rows].clone(), w[a, rows].clone()
    for i in others:
        if rng.uniform() < args.mutation_prob:
            for w in weights:
                mutate(w[i], args, rng)
    return elites, parents


def inject(weights, biases, fitness, actors):
    """Copy the learners' actors over the worst individuals (by the last fitness); returns their slots."""
    worst = np.argsort(fitness, kind="stable")[: len(actors)]
    learner_weights, learner_biases = stack_actors(actors)
    for p, q in zip(weights + biases, learner_weights + learner_biases):
        p[worst] = q
    return worst


def drop_evaluations_after(path, global_step):
    """On resume, forget evaluations made after the checkpoint: the resumed run makes them again."""
    if os.path.exists(path):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(rows[:1] + [row for row in rows[1:] if int(row[0]) <= global_step])


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
                action = policy(torch.as_tensor(obs, dtype=torch.float32, device=device)[None])[0].cpu().numpy()
            obs, reward, terminated, truncated, _ = env.step(to_env(action, low, high))
            episode_return += float(reward)
            done = terminated or truncated
        returns.append(episode_return)
    env.close()
    return returns


def main(args):
    check_args(args)
    checkpoint = None
    if args.resume:
        try:
            checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
            saved_args = checkpoint["args"]
        except Exception as e:
            fail(f"cannot read --resume file {args.resume}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        for name, value in asdict(args).items():
            if name not in RESUMABLE_FLAGS and saved_args.get(name) != value:
                fail(f"--resume file {args.resume} was made with --{name.replace('_', '-')} {saved_args.get(name)}, "
                     f"not {value}")
    check_env(args.env_id)
    if args.cuda and not torch.cuda.is_available():
        print("warning: --cuda is set but no GPU is available; running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.capture_video and "DISPLAY" not in os.environ:
        os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering

    if checkpoint:
        run_name = checkpoint["run_name"]
        run_dir = os.path.dirname(os.path.abspath(args.resume))
    else:
        run_name = f"{args.env_id.replace('/', '-').replace(':', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
        run_dir = os.path.abspath(os.path.join("runs", run_name))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=2)
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, config=asdict(args),
                   name=run_name, id=run_name[-64:].replace(".", "-"), resume="allow", save_code=True, dir=run_dir)
    writer = SummaryWriter(run_dir, purge_step=checkpoint["global_step"] if checkpoint else None)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)  # the genetic algorithm's draws

    # One env per individual and one per learner, each seeded once; after that their episodes follow their RNGs.
    envs = [make_env(args.env_id)() for _ in range(args.pop_size)]
    learner_envs = [make_env(args.env_id)() for _ in range(args.num_rl_agents)]
    for i, env in enumerate(envs + learner_envs):
        env.reset(seed=args.seed + i)
    obs_dim, act_dim = envs[0].observation_space.shape[0], envs[0].action_space.shape[0]

    weights, biases = stack_actors([Actor(obs_dim, act_dim).to(device) for _ in range(args.pop_size)])
    fitness = np.zeros(args.pop_size)
    actors = [Actor(obs_dim, act_dim).to(device) for _ in range(args.num_rl_agents)]
    actor_targets = [Actor(obs_dim, act_dim).to(device) for _ in range(args.num_rl_agents)]
    qfs = [Critic(obs_dim, act_dim).to(device) for _ in range(1 if args.shared_critic else args.num_rl_agents)]
    qf_targets = [Critic(obs_dim, act_dim).to(device) for _ in qfs]
    for target, source in zip(actor_targets + qf_targets, actors + qfs):
        target.load_state_dict(source.state_dict())
    # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
    actor_optimizers = [torch.optim.Adam(a.parameters(), lr=args.learning_rate, fused=True) for a in actors]
    q_optimizers = [torch.optim.Adam(q.parameters(), lr=args.learning_rate, fused=True) for q in qfs]
    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, device)
    modules = {"rb": rb, **{f"{name}_{k}": module for name, group in [
        ("actor", actors), ("actor_target", actor_targets), ("actor_optimizer", actor_optimizers), ("qf", qfs),
        ("qf_target", qf_targets), ("q_optimizer", q_optimizers)] for k, module in enumerate(group)}}

    global_step, num_updates, wall_time, generation = 0, 0, 0.0, 0
    injected = np.zeros(0, dtype=np.int64)  # the slots of the learners' copies, until the next genetic step
    fates = {"elite": 0, "selected": 0, "discarded": 0}
    if checkpoint:
        for name, module in modules.items():
            module.load_state_dict(checkpoint[name])
        for p, saved in zip(weights + biases, checkpoint["population"]["weights"] + checkpoint["population"]["biases"]):
            p.copy_(saved)
        fitness, injected, fates = (checkpoint["population"][k] for k in ("fitness", "injected", "fates"))
        for env, state in zip(envs + learner_envs, checkpoint["envs"]):  # episodes start with the generations: an
            env.unwrapped.np_random.bit_generator.state = state  # env's RNG is all it takes to continue it
        global_step, num_updates, wall_time, generation = (checkpoint[k] for k in ("global_step", "num_updates",
                                                                                   "wall_time", "generation"))
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        rng.bit_generator.state = checkpoint["rng"]["ga"]
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if device.type == "cuda" and checkpoint["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(checkpoint["rng"]["cuda"])
        drop_evaluations_after(os.path.join(run_dir, "evaluations.csv"), global_step)
        print(f"resumed {run_dir} at global_step {global_step}")

    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")

    def save_checkpoint():
        state = {name: module.state_dict() for name, module in modules.items()}
        state.update(args=asdict(args), run_name=run_name, global_step=global_step, num_updates=num_updates,
                     wall_time=wall_time + time.time() - start_time, generation=generation,
                     envs=[env.unwrapped.np_random.bit_generator.state for env in envs + learner_envs],
                     population={"weights": [w.cpu() for w in weights], "biases": [b.cpu() for b in biases],
                                 "fitness": fitness, "injected": injected, "fates": fates},
                     rng={"python": random.getstate(), "numpy": np.random.get_state(), "ga": rng.bit_generator.state,
                          "torch": torch.get_rng_state(),
                          "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None})
        torch.save(state, checkpoint_path + ".tmp")
        os.replace(checkpoint_path + ".tmp", checkpoint_path)  # a kill while writing leaves the old checkpoint whole

    def champion(obs):
        c = int(np.argmax(fitness))
        return population_forward([w[c:c + 1] for w in weights], [b[c:c + 1] for b in biases], obs)

    def run_evaluation():
        stop_if_nonfinite()
        video_folder = os.path.join("videos", run_name) if args.capture_video else None
        results = [evaluate(policy, args.env_id, args.eval_episodes, args.seed + 100_000, device, folder,
                            video_prefix=f"step-{global_step}") for policy, folder in [(champion, video_folder),
                                                                                      (actors[0], None)]]
        (mean, std), (learner_mean, learner_std) = [(float(np.mean(r)), float(np.std(r))) for r in results]
        writer.add_scalar("eval/episodic_return", mean, global_step)
        writer.add_scalar("eval/learner_episodic_return", learner_mean, global_step)
        path = os.path.join(run_dir, "evaluations.csv")
        new_file = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            out = csv.writer(f)
            if new_file:
                out.writerow(["global_step", "wall_time_s", "mean_return", "std_return", "returns",
                              "learner_mean_return", "learner_std_return"])
            out.writerow([global_step, round(wall_time + time.time() - start_time, 1), mean, std,
                          " ".join(f"{r:.2f}" for r in results[0]), learner_mean, learner_std])
        return mean, std, learner_mean

    def crossed(freq):
        return freq > 0 and global_step // freq != generation_start // freq

    # The generation's losses stay on the device until its end, so that a non-finite one can be reported without
    # waiting for the device after every update.
    losses = []

    def stop_if_nonfinite(cause=None):
        """Fail naming the first non-finite loss of this generation's updates."""
        if losses:
            history = torch.stack(losses)
            bad = (~torch.isfinite(history)).nonzero().tolist()
            if bad:
                i, which = bad[0]
                cause = (f"{('critic', 'actor')[which]} loss of learner {i % args.num_rl_agents} in update "
                         f"{i // args.num_rl_agents + 1} of generation {generation}, at global_step {global_step}")
        if cause:
            fail(f"non-finite {cause}; stopping. Last checkpoint: "
                 f"{checkpoint_path if os.path.exists(checkpoint_path) else 'none'}")

    stop_signal = []
    previous_handlers = {s: signal.signal(s, lambda signum, frame: stop_signal.append(signum))
                         for s in (signal.SIGINT, signal.SIGTERM)}
    actor_loss = [torch.zeros((), device=device)] * args.num_rl_agents
    start_time, sps_start, last_eval = time.time(), None, None
    print(f"run {run_dir}: {args.env_id}, {args.total_timesteps} steps on {device}")
    try:
        while global_step < args.total_timesteps:
            generation_start = global_step
            # 1. Fitness: every individual's episodes at once, without noise. 2. The learners' noisy episodes.
            fitness, population_steps = run_episodes(weights, biases, envs, args.episodes_for_fitness, 0.0, device, rb)
            learner_returns, learner_steps = run_episodes(*stack_actors(actors), learner_envs, 1,
                                                          args.exploration_noise, device, rb)
            global_step += population_steps + learner_steps
            if not np.isfinite(fitness).all():
                stop_if_nonfinite(f"fitness in generation {generation}, at global_step {global_step}")

            # 3. TD3 updates, --utd-ratio per env step of this generation, for each learner.
            losses.clear()
            if len(rb) >= args.learning_starts:
                if sps_start is None:
                    sps_start = (generation_start, time.time())
                for _ in range(int(args.utd_ratio * (global_step - generation_start))):
                    for k in range(args.num_rl_agents):
                        q = 0 if args.shared_critic else k
                        batch = rb.sample(args.batch_size)
                        qf_loss, q_values = update_critic(batch, actor_targets[k], qfs[q], qf_targets[q],
                                                          q_optimizers[q], args)
                        if num_updates % args.policy_frequency == 0:
                            actor_loss[k] = update_actor(batch[0], actors[k], qfs[q], actor_optimizers[k])
                            soft_update(actor_targets[k], actors[k], args.tau)
                            soft_update(qf_targets[q], qfs[q], args.tau)
                        losses.append(torch.stack((qf_loss, actor_loss[k])))
                    num_updates += 1
            stop_if_nonfinite()

            # 4. The genetic step; the fate of the learners' copies injected last time. 5. Injection.
            elites, parents = next_generation(weights, biases, fitness, args, rng)
            for slot in injected:
                fates["elite" if slot in elites else "selected" if slot in parents else "discarded"] += 1
            generation += 1
            injected = (inject(weights, biases, fitness, actors) if generation % args.rl_injection_interval == 0
                        else np.zeros(0, dtype=np.int64))

            for statistic in ("max", "mean", "min"):
                writer.add_scalar(f"evolution/fitness_{statistic}", getattr(fitness, statistic)(), global_step)
            writer.add_scalar("evolution/generation", generation, global_step)
            for fate, count in fates.items():  # the "RL selection rate": elite + selected over all injections
                writer.add_scalar(f"evolution/injected_{fate}", count / max(sum(fates.values()), 1), global_step)
            for k, episode_return in enumerate(learner_returns):  # learner 0's under CleanRL's name
                writer.add_scalar("charts/episodic_return" + (f"_{k}" if k else ""), episode_return, global_step)
            if losses:
                sps = (global_step - sps_start[0]) / max(time.time() - sps_start[1], 1e-9)
                writer.add_scalar("losses/qf1_values", q_values[0].item(), global_step)
                writer.add_scalar("losses/qf2_values", q_values[1].item(), global_step)
                writer.add_scalar("losses/qf_loss", qf_loss.item() / 2.0, global_step)
                writer.add_scalar("losses/actor_loss", actor_loss[-1].item(), global_step)
                writer.add_scalar("charts/SPS", int(sps), global_step)

            if crossed(args.eval_freq):
                last_eval = (global_step, *run_evaluation())
                sps = (global_step - sps_start[0]) / max(time.time() - sps_start[1], 1e-9) if sps_start else 0.0
                eta = f"{(args.total_timesteps - global_step) / sps / 60:.1f} min" if sps else "-"
                print(f"step {global_step}/{args.total_timesteps} | generation {generation} | eval return "
                      f"{last_eval[1]:.1f} +- {last_eval[2]:.1f} (learner {last_eval[3]:.1f}) | fitness max "
                      f"{fitness.max():.1f} mean {fitness.mean():.1f} | SPS {sps:.0f} | ETA {eta}", flush=True)
            if crossed(args.checkpoint_freq):
                save_checkpoint()
            if stop_signal:
                save_checkpoint()
                name = signal.Signals(stop_signal[0]).name
                print(f"{name} at global_step {global_step}: checkpoint written to {checkpoint_path}; "
                      f"continue with --resume {checkpoint_path}", file=sys.stderr)
                sys.exit(128 + stop_signal[0])

        if last_eval is None or last_eval[0] != global_step:
            last_eval = (global_step, *run_evaluation())
        if args.checkpoint_freq:
            save_checkpoint()
        if args.save_model:
            torch.save({"population": {"weights": [w.cpu() for w in weights], "biases": [b.cpu() for b in biases],
                                       "fitness": fitness}, "actors": [a.state_dict() for a in actors],
                        "qfs": [q.state_dict() for q in qfs], "args": asdict(args)}, os.path.join(run_dir, "model.pt"))
        print(f"done: {global_step} steps, {generation} generations, final eval return {last_eval[1]:.1f} +- "
              f"{last_eval[2]:.1f} (learner {last_eval[3]:.1f})")
    finally:
        for s, handler in previous_handlers.items():
            signal.signal(s, handler)
        for env in envs + learner_envs:
            env.close()
        writer.close()
        if args.track:
            wandb.finish()
    return {"run_dir": run_dir, "global_step": global_step, "eval_mean": last_eval[1], "eval_std": last_eval[2],
            "learner_eval_mean": last_eval[3]}


if __name__ == "__main__":
    main(tyro.cli(Args))
