"""The ATen ops dispatched per update inside each script's update callables (the ones `accelerate` returns), on the
CPU's eager path: benchmark/profile_update.py's count, the GPU-free proxy for kernels per update, held under a stated
number per script, so that an op added to an update fails here; and every phase of --breakdown is found. Each script
runs through its real main, on the benchmark's workload (Hopper-v4, CartPole-v1 for sac_discrete) with a tiny
buffer and batch and a few updates."""

import importlib

import pytest

from benchmark.profile_update import OUTSIDE, Probe, difference
from benchmark.speed import workload_flags
from tests.conftest import SCRIPTS, flags_with, run_main

# ATen ops per update in the callables, averaged over the updates of the run (TD3's and ERL's actor, SAC's policy
# and TD7's actor step come every 2nd update). Measured on main at 89a731b (2026-12-04, torch 2.13.0 CPU): these
# tests' runs and `python benchmark/profile_update.py --ops` (1000 updates against 10 at batch 256) gave
# td3 128.5, td7 531.8-536.5 (its mix of the two kinds of update follows its bursts), sac 300, sac_discrete 268
# and erl 139.1-140, the same per call of each callable at every length tried (4-1000 updates). Each limit is that
# count + 5%, rounded up. When a change removes ops, lower the limit to the new count + 5%: td7 at 29c62c9
# (2026-12-06, CatLinear), 517.8 in its test's run and 520.4 in the benchmark's (417 and 624 per call).
LIMITS = {"td3_continuous": 135, "td7_continuous": 547, "sac_continuous": 315, "sac_discrete": 282, "erl_td3": 147}
# The updates of the short and the long run, whose difference is counted; ERL runs whole generations (of a
# population of 2 here), so its runs differ by a generation or more.
RUNS = {"erl_td3": (10, 200)}
SMALL = {"erl_td3": ["--pop-size", "2", "--num-elites", "1"]}


@pytest.mark.parametrize("script", SCRIPTS)
def test_aten_ops_per_update_stay_under_the_limit(script, tmp_path, monkeypatch):
    totals = []
    for updates in RUNS.get(script, (20, 60)):
        flags = workload_flags(script, "cpu", updates, threads=1) + SMALL.get(script, [])
        flags = flags_with(flags, learning_starts=100, total_timesteps=100 + updates, buffer_size=1000, batch_size=32)
        with Probe(importlib.import_module(script), count_ops=True) as probe:
            run_main(script, flags, tmp_path / str(updates), monkeypatch)
        totals.append(probe.totals())
    measured = difference(*totals)
    ops = measured["ops_per_update"]
    assert ops > 0, f"no ATen op counted in the updates: {measured}"
    assert all(totals[1]["calls"].get(phase) for phase in OUTSIDE[:-1]), f"a phase never entered: {totals[1]}"
    assert ops <= LIMITS[script], f"{ops:.1f} ATen ops per update, over {LIMITS[script]}: {measured['ops_per_call']}"
