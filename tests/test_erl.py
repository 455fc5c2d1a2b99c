"""Unit tests of ERL's genetic operators, injection and batched population evaluation."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import erl_td3
from tests.conftest import (
    ERL_SMALL,
    TINY,
    assert_same,
    flags_with,
    load_checkpoint,
    logged_losses,
    run_cli,
    run_main,
    signal_when,
    start_cli,
)

ARGS = erl_td3.Args()


def population(size=6, obs_dim=3, act_dim=1, seed=0, hidden=256):
    torch.manual_seed(seed)
    return erl_td3.stack_actors([erl_td3.Actor(obs_dim, act_dim, hidden) for _ in range(size)])


def test_mutation_changes_about_the_stated_fraction():
    """A matrix is mutated with probability P(U(0, 1) < U(0, 2)) = 3/4, and then a number of entries drawn from
    [0, ceil(10%)) = [0, 200) of its 2000, with replacement: about 5% of them on average (ERL's count), never more
    than 199; with EvoRL's fixed count exactly 200 distinct ones."""
    rng = np.random.default_rng(0)
    changed = []
    for _ in range(400):
        w = torch.randn(40, 50)
        before = w.clone()
        erl_td3.mutate(w, ARGS, rng)
        changed.append((w != before).sum().item())
    changed = np.array(changed)
    assert 0.68 < (changed > 0).mean() < 0.82
    assert 0.045 < changed[changed > 0].mean() / 2000 < 0.056
    assert changed.max() <= 199
    for _ in range(40):
        w = torch.randn(40, 50)
        before = w.clone()
        erl_td3.mutate(w, ARGS, rng, fixed_count=True)
        assert (w != before).sum().item() in (0, 200)


def test_mutation_equals_erls_loop_entry_by_entry():
    """ERL's mutate_inplace perturbs its drawn entries one after another, so an entry drawn twice is perturbed twice,
    and clips each: the vectorised mutation equals that loop, run on the same draws, bit for bit."""
    args = erl_td3.Args(mutation_frac=0.5, weight_max_magnitude=2.0, super_mutation_prob=0.2, reset_prob=0.2)
    repeated = 0
    for seed in range(30):
        w = torch.randn(4, 5)
        expected = w.clone().view(-1)
        draws = np.random.default_rng(seed)
        if draws.uniform() < draws.uniform(0.0, 2.0):
            idx = draws.integers(0, 20, int(draws.integers(0, 10)))
            kinds, gauss = draws.uniform(size=len(idx)), draws.standard_normal(len(idx))
            repeated += len(idx) - len(set(idx.tolist()))
            for i, kind, g in zip(idx, torch.tensor(kinds, dtype=w.dtype), torch.tensor(gauss, dtype=w.dtype)):
                old = expected[i].clone()
                if kind < args.super_mutation_prob:
                    new = old + g * old.abs() * args.super_mutation_strength
                elif kind < args.super_mutation_prob + args.reset_prob:
                    new = g
                else:
                    new = old + g * old.abs() * args.mutation_strength
                expected[i] = new.clamp(-args.weight_max_magnitude, args.weight_max_magnitude)
        erl_td3.mutate(w, args, np.random.default_rng(seed))
        assert torch.equal(w.view(-1), expected)
    assert repeated > 0  # the draws above did draw entries twice


def test_mutation_respects_the_clip():
    rng = np.random.default_rng(1)
    args = erl_td3.Args(weight_max_magnitude=0.5, super_mutation_prob=0.5)
    for _ in range(50):
        w = torch.empty(30, 30).uniform_(-0.4, 0.4)
        erl_td3.mutate(w, args, rng)
        assert w.abs().max() <= 0.5


def test_tournament_prefers_fitter_individuals():
    rank = np.arange(10)[::-1].copy()  # individual 9 is the best
    wins = np.bincount(erl_td3.tournament(rank, 100_000, 3, np.random.default_rng(0)), minlength=10) / 100_000
    expected = [((i + 1) ** 3 - i**3) / 1000 for i in range(10)]  # P(the best of 3 draws is individual i)
    assert np.allclose(wins, expected, atol=0.005)
    assert (np.diff(wins) > 0).all()


def columns(p, slot):
    """The neurons of one individual's layer: the columns of its (n_in, n_out) weights or (1, n_out) biases."""
    return [p[slot][..., c] for c in range(p.shape[-1])]


def test_genetic_step_copies_elites_keeps_winners_and_fills_the_rest_by_crossover():
    """Without mutation: the elites' copies are bitwise the best individuals; winners keep their slots; every other
    slot is a crossover child, neuron by neuron a copy of an elite or a winner, and mixes them in some neurons."""
    weights, biases = population(size=10)
    old = [p.clone() for p in weights + biases]
    fitness = np.array([5.0, 1.0, 9.0, 3.0, 7.0, 0.0, 2.0, 8.0, 4.0, 6.0])
    args = erl_td3.Args(num_elites=2, mutation_prob=0.0)
    copies, elites, selected, _ = erl_td3.next_generation(weights, biases, fitness, args, np.random.default_rng(4))
    assert elites.tolist() == [2, 7]
    for copy, elite in zip(copies, elites):
        assert all(torch.equal(p[copy], o[elite]) for p, o in zip(weights + biases, old))
    kept = [w for w in set(selected.tolist()) if w not in copies]
    for slot in kept:
        assert all(torch.equal(p[slot], o[slot]) for p, o in zip(weights + biases, old))
    children = [i for i in range(10) if i not in copies and i not in kept and i not in elites]
    assert children
    parents = list(elites) + kept
    mixed = 0
    for slot in children:
        for p, o in zip(weights + biases, old):
            sources = [
                {j for j in parents if torch.equal(column, o[j][..., c])} for c, column in enumerate(columns(p, slot))
            ]
            assert all(sources)  # each neuron comes from an elite or a winner
            mixed += len(set.intersection(*sources)) == 0  # no single parent gives all of its neurons
    assert mixed > 0


def test_elites_copies_are_spared_mutation():
    weights, biases = population(size=10)
    old = [p.clone() for p in weights + biases]
    fitness = np.arange(10.0)
    copies, elites, *_ = erl_td3.next_generation(
        weights, biases, fitness, erl_td3.Args(mutation_prob=1.0), np.random.default_rng(0)
    )
    for copy, elite in zip(copies, elites):
        assert all(torch.equal(p[copy], o[elite]) for p, o in zip(weights + biases, old))


def test_share_of_crossover_children_matches_a_direct_simulation_of_erls_rule():
    """Population 10, 2 elites: the genetic step fills by crossover every slot that is neither selected by the
    tournaments (8 of size 3 over the ranks, duplicates removed) nor an elite, once the elites' copies took their
    slots (an elite's own slot, unselected, keeps it). A direct simulation of that rule and the genetic step itself
    agree on the mean number of such children. (Actors of 8 hidden units: the count does not depend on their size, and
    2000 genetic steps of 256-unit ones took 3 minutes.)"""
    rng = np.random.default_rng(0)
    draws = rng.integers(0, 10, (100_000, 8, 3)).min(2)  # the winners' ranks
    expected = np.mean([max(0, 10 - len(set(w) | {0, 1}) - 2) for w in draws])
    weights, biases = population(size=10, hidden=8)
    args, measured = erl_td3.Args(num_elites=2, mutation_prob=0.0), []
    for _ in range(2000):
        copies, elites, selected, _ = erl_td3.next_generation(weights, biases, rng.normal(size=10), args, rng)
        measured.append(10 - len(set(copies.tolist()) | set(selected.tolist()) | set(elites.tolist())))
    assert abs(np.mean(measured) - expected) < 4 * np.std(measured) / np.sqrt(len(measured))
    assert 2.5 < expected < 4  # about 3 of the 10 slots a generation


def test_crossover_copies_whole_neurons_between_two_individuals():
    weights, biases = population(size=2)
    old = [p.clone() for p in weights + biases]
    erl_td3.crossover(weights, biases, 0, 1, np.random.default_rng(3))
    copied = 0
    for p, o in zip(weights + biases, old):
        for c in range(p.shape[-1]):
            a, b = p[0][..., c], p[1][..., c]
            assert (torch.equal(a, o[0][..., c]) and torch.equal(b, o[1][..., c])) or torch.equal(a, b)
            copied += torch.equal(a, b) and not torch.equal(o[0][..., c], o[1][..., c])
    assert copied > 0


def test_mutation_only_variant_keeps_elites_in_place():
    weights, biases = population(size=6)
    old = [p.clone() for p in weights + biases]
    fitness = np.array([5.0, 1.0, 9.0, 3.0, 7.0, 0.0])
    args = erl_td3.Args(num_elites=2, mutation_prob=1.0, genetic_step="mutation-only")
    copies, elites, winners, _ = erl_td3.next_generation_mutation_only(
        weights, biases, fitness, args, np.random.default_rng(0)
    )
    assert sorted(copies.tolist()) == [2, 4]
    for i in copies:
        assert all(torch.equal(p[i], o[i]) for p, o in zip(weights + biases, old))
    others = [i for i in range(6) if i not in copies]
    for slot, winner in zip(others, winners):  # each child: its winner's biases, and mutated weights
        assert all(torch.equal(b[slot], o[winner]) for b, o in zip(biases, old[len(weights) :]))


def test_learners_go_over_the_worst_by_the_fitness_before_the_genetic_step():
    """ERL's rule (`run_erl.py`): the learners' slots are the worst by the fitness the genetic step ranked, whatever
    the step put there (an elite's copy too); with tied fitness, the first index (ERL's `index(min(...))`). inject
    copies the learners' actors into those slots."""
    weights, biases = population(size=6)
    fitness = np.array([5.0, 1.0, 9.0, 3.0, 7.0, -3.0])
    *_, slots = erl_td3.next_generation(weights, biases, fitness, erl_td3.Args(), np.random.default_rng(0), 2)
    assert slots == [5, 1]
    _, _, _, tied = erl_td3.next_generation(weights, biases, np.zeros(6), erl_td3.Args(), np.random.default_rng(0), 1)
    assert tied == [0]
    learners = [erl_td3.Actor(3, 1), erl_td3.Actor(3, 1)]
    erl_td3.inject(weights, biases, slots, learners)
    for slot, learner in zip(slots, learners):
        ws, bs = erl_td3.actor_params(learner)
        assert all(torch.equal(w[slot], x) for w, x in zip(weights + biases, ws + bs))


def test_mutation_only_leaves_the_learners_slots_out_of_selection():
    """EvoRL's mutation-only step with one learner due: the worst individual is no parent and keeps its slot, the
    elites stay, every other slot is a mutated copy of a winner among the rest."""
    weights, biases = population(size=6)
    old = [p.clone() for p in weights + biases]
    fitness = np.array([5.0, 1.0, 9.0, 3.0, 7.0, -3.0])
    args = erl_td3.Args(num_elites=2, tournament_size=6, genetic_step="mutation-only")
    for seed in range(20):
        _, elites, winners, slots = erl_td3.next_generation_mutation_only(
            [p.clone() for p in old[:3]], [p.clone() for p in old[3:]], fitness, args, np.random.default_rng(seed), 1
        )
        assert slots == [5]
        assert 5 not in winners.tolist() and sorted(elites.tolist()) == [2, 4]


def test_population_forward_is_the_actor():
    """The population's batched forward pass computes each Actor's own forward (so a change to Actor that
    population_forward does not follow fails here)."""
    torch.manual_seed(0)
    actors = [erl_td3.Actor(5, 2) for _ in range(3)]
    weights, biases = erl_td3.stack_actors(actors)
    obs = torch.randn(3, 5)
    together = erl_td3.population_forward(weights, biases, obs)
    for i, actor in enumerate(actors):
        assert torch.allclose(together[i], actor(obs[i : i + 1])[0], atol=1e-6)


def test_erls_own_actors_in_the_population():
    """--actor-layer-norm (ERL's actors: each hidden layer normalised, then tanh): the population's batched forward
    pass still computes each Actor's own forward, its LayerNorms crossed like biases and never mutated; the learner's
    output layer is scaled at initialisation (ERL's 0.1), from the same draws as an unscaled one."""
    torch.manual_seed(0)
    actors = [erl_td3.Actor(5, 2, hidden=16, layer_norm=True) for _ in range(3)]
    for actor in actors:  # LayerNorms away from their initial ones and zeros
        for norm in [m for m in actor.net if isinstance(m, torch.nn.LayerNorm)]:
            torch.nn.init.normal_(norm.weight)
            torch.nn.init.normal_(norm.bias)
    weights, biases = erl_td3.stack_actors(actors)
    assert len(weights) == 3 and len(biases) == 3 + 4  # 3 layers' biases, then 2 LayerNorms' weight and bias
    obs = torch.randn(3, 5)
    together = erl_td3.population_forward(weights, biases, obs)
    for i, actor in enumerate(actors):
        assert torch.allclose(together[i], actor(obs[i : i + 1])[0], atol=1e-5)
    norms = [b.clone() for b in biases[3:]]
    erl_td3.next_generation(weights, biases, np.array([3.0, 2.0, 1.0]), ARGS, np.random.default_rng(0))
    for before, after in zip(norms, biases[3:]):  # whole neurons copied between individuals, no value new
        assert set(after.flatten().tolist()) <= set(before.flatten().tolist())
    torch.manual_seed(1)
    plain = erl_td3.Actor(5, 2)
    torch.manual_seed(1)
    scaled = erl_td3.Actor(5, 2, init_scale=0.1)
    assert torch.equal(scaled.net[-2].weight, plain.net[-2].weight * 0.1)
    assert torch.equal(scaled.net[0].weight, plain.net[0].weight)


def test_erls_learner_settings_run_and_log_the_learners_saturation(tmp_path, monkeypatch):
    """ERL's own learner (LayerNorm actors of 128, output scaled by 0.1, its learning rates, tau, batch and critic
    gradient clip) trains, and every generation logs the best return yet and, once the learner has trained, the share
    of its actions at a bound; the optimizers take the two learning rates, and the checkpoint keeps the best return."""
    erls = ["--actor-layer-norm", "--actor-hidden", "128", "--learner-init-scale", "0.1", "--actor-lr", "5e-5"]
    erls += ["--critic-lr", "5e-4", "--critic-grad-clip", "10", "--tau", "0.001", "--batch-size", "128"]
    flags = flags_with(TINY, env_id="Pendulum-v1", total_timesteps=2400, learning_starts=400, **ERL_SMALL)
    flags = flags_with(flags, eval_freq=0, checkpoint_freq=1200) + erls
    run = run_main("erl_td3", flags, tmp_path, monkeypatch)
    checkpoint = load_checkpoint(run["run_dir"])
    assert checkpoint["state"]["actor_optimizer_0"]["param_groups"][0]["lr"] == 5e-5
    assert checkpoint["state"]["q_optimizer_0"]["param_groups"][0]["lr"] == 5e-4
    assert "net.1.weight" in checkpoint["state"]["actor_0"]  # the first LayerNorm
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run["run_dir"])
    events.Reload()
    best = [event.value for event in events.Scalars("charts/best_return")]
    saturation = [event.value for event in events.Scalars("charts/learner_saturation")]
    assert len(best) == 4 and best == sorted(best)  # a generation is 600 steps here, the first without updates
    assert checkpoint["run"]["best_return"] == pytest.approx(best[-1])  # kept for a resumed run
    assert len(saturation) == 4 and all(0 <= s <= 1 for s in saturation)


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
        alone, _ = erl_td3.run_episodes(
            [w[i : i + 1] for w in weights], [b[i : i + 1] for b in biases], [env], 1, 0.0, torch.device("cpu")
        )
        assert alone[0] == pytest.approx(batched[i], rel=1e-4)  # a batched matmul may round differently
    assert len(set(batched.tolist())) == 5  # five different actors, five different returns


def test_shared_critic(tmp_path, monkeypatch):
    """--shared-critic with two learners: two actors and one critic, which takes one Adam step per update step (on
    the mean of the two learners' losses, as EvoRL)."""
    flags = flags_with(
        TINY,
        env_id="Pendulum-v1",
        total_timesteps=1200,
        learning_starts=400,
        pop_size=3,
        num_elites=1,
        num_rl_agents=2,
        eval_freq=0,
    ) + ["--shared-critic"]
    run = run_main("erl_td3", flags, tmp_path, monkeypatch)
    checkpoint = load_checkpoint(run["run_dir"])
    assert {"qf_0", "actor_0", "actor_1"} <= checkpoint["state"].keys()
    assert "qf_1" not in checkpoint["state"]
    num_updates = checkpoint["loop"]["num_updates"]
    assert num_updates > 0
    critic_steps = {int(s["step"]) for s in checkpoint["state"]["q_optimizer_0"]["state"].values()}
    assert critic_steps == {num_updates}


def test_learners_are_injected_only_once_they_have_trained(tmp_path, monkeypatch):
    """Pendulum, a population of 3 and a learner: a generation is 800 steps. Updates start in the second (1400
    stored steps), so the first injection follows it and the first fate is counted in the third genetic step."""
    flags = flags_with(
        TINY,
        env_id="Pendulum-v1",
        total_timesteps=3200,
        learning_starts=1400,
        buffer_size=4000,
        pop_size=3,
        num_elites=1,
        eval_freq=0,
        checkpoint_freq=800,
    )
    run = run_main("erl_td3", flags, tmp_path, monkeypatch)
    loop = load_checkpoint(run["run_dir"])["loop"]
    assert loop["generation"] == 4
    assert sum(loop["fates"].values()) == loop["generation"] - 2
    assert len(loop["injected"]) == 1


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num-elites", "10"], "exceed --pop-size"),
        (["--mutation-prob", "1.5"], "--mutation-prob must lie in [0, 1]"),
    ],
)
def test_bad_evolution_flags(flags, message, tmp_path):
    result = run_cli("erl_td3", flags, tmp_path, timeout=60)
    assert result.returncode == 1
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_signal_during_a_generations_updates(tmp_path):
    """Pendulum, a population of 3 and a learner: 800 steps a generation, none learnt from in the first (1000 must be
    stored), 8 updates per step in the second. SIGTERM in the second's updates ends the run within seconds with a
    checkpoint that keeps the updates still due; --resume makes them and finishes the run as an uninterrupted run does,
    bit for bit."""
    flags = flags_with(
        TINY,
        env_id="Pendulum-v1",
        total_timesteps=1600,
        learning_starts=1000,
        buffer_size=2000,
        pop_size=3,
        num_elites=1,
        utd_ratio=8,
        eval_freq=0,
        checkpoint_freq=800,
    )
    cwd = tmp_path / "signalled"
    cwd.mkdir()
    proc = start_cli("erl_td3", flags, cwd)
    # The first generation's end writes a checkpoint; the second's episodes (800 steps) take a fraction of the 2 s
    # after it, and 6400 updates follow.
    stderr = signal_when(proc, lambda: list((cwd / "runs").glob("*/checkpoint.pt")), settle=2.0, within=5)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("SIGTERM at global_step 1600: checkpoint written"), stderr
    (run_dir,) = (cwd / "runs").iterdir()
    loop = load_checkpoint(run_dir)["loop"]
    assert 0 < loop["updates_due"] < 6400
    assert loop["num_updates"] + loop["updates_due"] == 6400 and loop["generation"] == 1

    result = run_cli("erl_td3", ["--resume", str(run_dir / "checkpoint.pt")], cwd)
    assert result.returncode == 0, result.stderr
    (tmp_path / "straight").mkdir()
    straight = run_cli("erl_td3", flags, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    (straight_dir,) = (tmp_path / "straight" / "runs").iterdir()
    a, b = load_checkpoint(straight_dir), load_checkpoint(run_dir)
    for key in ("args", "run"):  # the flags given and the times differ by design
        a.pop(key), b.pop(key)
    assert_same(a, b)
    assert b["loop"]["updates_due"] == 0 and b["loop"]["generation"] == 2
    assert logged_losses(straight_dir) == logged_losses(run_dir)  # no point at 1600 from the updates' first part


def test_compile_keeps_compiling_every_learners_steps(tmp_path, monkeypatch):
    """--compile with 6 learners: each learner's steps are the same functions on other tensors, one compilation each,
    more than dynamo's default limit of 8 a function allows; past it dynamo would run them eagerly without a word.
    Dynamo is told to fail instead, and traces with its eager backend (the limit is dynamo's, not inductor's)."""
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda step: compile(step, backend="eager"))
    flags = flags_with(
        TINY,
        env_id="Pendulum-v1",
        total_timesteps=1000,
        learning_starts=400,
        pop_size=7,
        num_elites=1,
        num_rl_agents=6,
        eval_freq=0,
        utd_ratio=0.01,  # one generation (2600 steps): 26 updates of each learner compile and run all its steps
    ) + ["--compile"]
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # torch's own patch (see test_fast_path)
            assert run_main("erl_td3", flags, tmp_path, monkeypatch)["global_step"] >= 1000
    finally:
        torch._dynamo.reset()
