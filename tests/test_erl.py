"""Unit tests of ERL's genetic operators, injection and batched population evaluation."""
import gymnasium as gym
import numpy as np
import pytest
import torch

import erl_td3
from tests.conftest import TINY, flags_with, load_checkpoint, run_cli, run_main

ARGS = erl_td3.Args()


def population(size=6, obs_dim=3, act_dim=1, seed=0):
    torch.manual_seed(seed)
    return erl_td3.stack_actors([erl_td3.Actor(obs_dim, act_dim) for _ in range(size)])


def test_mutation_changes_about_the_stated_fraction():
    """A matrix is mutated with probability P(U(0, 1) < U(0, 2)) = 3/4; a mutated one has ceil(10%) of its entries
    drawn with replacement, so about 1 - exp(-0.1) = 9.5% of them change."""
    rng = np.random.default_rng(0)
    changed = []
    for _ in range(400):
        w = torch.randn(40, 50)
        before = w.clone()
        erl_td3.mutate(w, ARGS, rng)
        changed.append((w != before).float().mean().item())
    changed = np.array(changed)
    assert 0.68 < (changed > 0).mean() < 0.82
    assert 0.085 < changed[changed > 0].mean() < 0.105


def test_mutation_respects_the_clip():
    rng = np.random.default_rng(1)
    args = erl_td3.Args(weight_max_magnitude=0.5, super_mutation_prob=0.5)
    for _ in range(50):
        w = torch.empty(30, 30).uniform_(-0.4, 0.4)
        erl_td3.mutate(w, args, rng)
        assert w.abs().max() <= 0.5


def test_genetic_step_keeps_elites_and_mutates_only_weight_matrices():
    weights, biases = population()
    old_w, old_b = [w.clone() for w in weights], [b.clone() for b in biases]
    fitness = np.array([5.0, 1.0, 9.0, 3.0, 7.0, 0.0])
    args = erl_td3.Args(num_elites=2, mutation_prob=1.0)
    elites, parents = erl_td3.next_generation(weights, biases, fitness, args, np.random.default_rng(0))
    assert sorted(elites.tolist()) == [2, 4]  # the two best, unchanged in their slots
    for i in elites:
        assert all(torch.equal(w[i], o[i]) for w, o in zip(weights + biases, old_w + old_b))
    others = [i for i in range(6) if i not in elites]
    for slot, parent in zip(others, parents):  # each child: its parent's biases, and mutated weights
        assert all(torch.equal(b[slot], o[parent]) for b, o in zip(biases, old_b))
    assert any(not torch.equal(w[slot], o[parent])
               for slot, parent in zip(others, parents) for w, o in zip(weights, old_w))


def test_tournament_prefers_fitter_individuals():
    fitness = np.arange(10.0)
    wins = np.bincount(erl_td3.tournament(fitness, 100_000, 3, np.random.default_rng(0)), minlength=10) / 100_000
    expected = [((i + 1) ** 3 - i ** 3) / 1000 for i in range(10)]  # P(the best of 3 draws is individual i)
    assert np.allclose(wins, expected, atol=0.005)
    assert (np.diff(wins) > 0).all()


def test_crossover_swaps_rows_between_children():
    """With crossover always on and no mutation, each pair of children holds, row by row, its two parents' rows,
    some of them swapped."""
    weights, biases = population(size=4)
    old = [w.clone() for w in weights]
    args = erl_td3.Args(num_elites=0, crossover_prob=1.0, mutation_prob=0.0)
    _, parents = erl_td3.next_generation(weights, biases, np.arange(4.0), args, np.random.default_rng(3))
    swapped = 0
    for a, b in [(0, 1), (2, 3)]:
        pa, pb = parents[a], parents[b]
        for w, o in zip(weights, old):
            same = (w[a] == o[pa]).all(1) & (w[b] == o[pb]).all(1)
            crossed = (w[a] == o[pb]).all(1) & (w[b] == o[pa]).all(1)
            assert (same | crossed).all()
            swapped += int((crossed & ~same).sum()) if pa != pb else 0
    assert swapped > 0


def test_injection_replaces_the_worst():
    weights, biases = population()
    fitness = np.array([5.0, 1.0, 9.0, -3.0, 7.0, 0.0])
    learners = [erl_td3.Actor(3, 1), erl_td3.Actor(3, 1)]
    slots = erl_td3.inject(weights, biases, fitness, learners)
    assert slots.tolist() == [3, 5]
    for slot, learner in zip(slots, learners):
        ws, bs = erl_td3.actor_params(learner)
        assert all(torch.equal(w[slot], x) for w, x in zip(weights + biases, ws + bs))


def test_batched_population_evaluation_equals_one_at_a_time():
    """The population's episodes, all at once with one batched forward pass per step, return what each actor returns
    when evaluated alone on an env with the same seed (up to the rounding of a batched against a single matmul,
    about 1e-7 per action)."""
    weights, biases = population(size=5, obs_dim=3, act_dim=1)
    envs = [gym.make("Pendulum-v1") for _ in range(5)]
    for i, env in enumerate(envs):
        env.reset(seed=100 + i)
    batched, steps = erl_td3.run_episodes(weights, biases, envs, 1, 0.0, torch.device("cpu"))
    assert steps == 5 * 200
    for i in range(5):
        env = gym.make("Pendulum-v1")
        env.reset(seed=100 + i)
        alone, _ = erl_td3.run_episodes([w[i:i + 1] for w in weights], [b[i:i + 1] for b in biases], [env], 1, 0.0,
                                        torch.device("cpu"))
        assert alone[0] == pytest.approx(batched[i], rel=1e-4)  # a batched matmul may round differently
    assert len(set(batched.tolist())) == 5  # five different actors, five different returns


def test_shared_critic(tmp_path, monkeypatch):
    """--shared-critic with two learners: two actors and one critic, which takes an Adam step for each learner in
    every update step; both injected actors' fates are counted in every genetic step after the first injection."""
    flags = flags_with(TINY, env_id="Pendulum-v1", total_timesteps=1200, learning_starts=400, pop_size=3,
                       num_elites=1, num_rl_agents=2, eval_freq=0) + ["--shared-critic"]
    run = run_main("erl_td3", flags, tmp_path, monkeypatch)
    checkpoint = load_checkpoint(run["run_dir"])
    assert {"qf_0", "actor_0", "actor_1"} <= checkpoint["state"].keys()
    assert "qf_1" not in checkpoint["state"]
    global_step, num_updates, generation, fitness, injected, fates = checkpoint["counters"]
    assert num_updates > 0
    critic_steps = {int(s["step"]) for s in checkpoint["state"]["q_optimizer_0"]["state"].values()}
    assert critic_steps == {2 * num_updates}
    assert sum(fates.values()) == 2 * (generation - 1)


@pytest.mark.parametrize("flags,message", [
    (["--num-elites", "10"], "exceed --pop-size"),
    (["--mutation-prob", "1.5"], "--mutation-prob must lie in [0, 1]"),
])
def test_bad_evolution_flags(flags, message, tmp_path):
    result = run_cli("erl_td3", flags, tmp_path, timeout=60)
    assert result.returncode == 1
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
