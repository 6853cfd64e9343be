"""Fuzzing every reader: mutated run directories (torch, a crashed rank's journal, Horovod with its timeline, the
recorded MXNet run), Kineto traces, applied configs and ``--set`` values end in success or one ``DproError``,
never another exception. Hypothesis draws the mutations (tests/fuzzing.py); the corpus replays the inputs
that once failed (tests/data/fuzz/corpus.jsonl, from bench/fuzz.py). The longer campaign, each input in its
own process under a memory limit and a timeout, is ``make fuzz``."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from fuzzing import SEEDS, Mutation, apply_mutation, in_process, random_mutation, read_corpus
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpro.errors import DproError

CORPUS = read_corpus()


@pytest.fixture(scope="module")
def built_seeds(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seeds")
    return {name: seed.build(root / name) for name, seed in SEEDS.items()}


def _fresh(built: Path, into: Path) -> Path:
    """A copy of a built seed to mutate."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    if built.is_dir():
        return Path(shutil.copytree(built, into / built.name, symlinks=True))
    return Path(shutil.copy(built, into / built.name))


def _read_mutated(seed_name: str, built: Path, mutation: Mutation, work: Path) -> None:
    """Mutate a fresh copy and read it; a refusal must say which file or argument is at fault."""
    seed = SEEDS[seed_name]
    path = _fresh(built, work / "case")
    outside = work / "outside"
    outside.mkdir(exist_ok=True)
    extra = apply_mutation(path, mutation, outside)
    try:
        in_process(seed, path, extra)
    except DproError as err:
        said = str(err)
        assert said.strip() and "\n" not in said.strip().split("\n")[0]
        if mutation.op != "set_arg":
            assert str(path) in said, f"{said!r} does not name {path}"


FUZZ_SETTINGS = {"deadline": None, "derandomize": True,
                 "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}
TRACE_SEEDS = sorted(name for name, seed in SEEDS.items() if seed.kind == "kineto")


@pytest.mark.parametrize("seed_name", sorted(set(SEEDS) - set(TRACE_SEEDS)))
@settings(max_examples=40, **FUZZ_SETTINGS)
@given(rng=st.randoms(use_true_random=False))
def test_a_mutated_input_is_read_or_refused_with_a_dpro_error(seed_name, rng: random.Random, built_seeds,
                                                              tmp_path):
    built = built_seeds[seed_name]
    _read_mutated(seed_name, built, random_mutation(rng, built, SEEDS[seed_name]), tmp_path)


@pytest.mark.parametrize("seed_name", TRACE_SEEDS)
@settings(max_examples=15, **FUZZ_SETTINGS)  # a Kineto trace takes about 1 s to mutate and read
@given(rng=st.randoms(use_true_random=False))
def test_a_mutated_profiler_trace_is_read_or_refused_with_a_dpro_error(seed_name, rng: random.Random, built_seeds,
                                                                      tmp_path):
    built = built_seeds[seed_name]
    _read_mutated(seed_name, built, random_mutation(rng, built, SEEDS[seed_name]), tmp_path)


@pytest.mark.skipif(not CORPUS, reason="no corpus")
@pytest.mark.parametrize(("seed_name", "mutation", "found"), CORPUS,
                         ids=[f"{s}-{m.op}-{i}" for i, (s, m, _) in enumerate(CORPUS)])
def test_an_input_that_once_failed_is_refused_cleanly(seed_name, mutation, found, built_seeds, tmp_path):
    _read_mutated(seed_name, built_seeds[seed_name], mutation, tmp_path)


def test_mutations_are_data_that_replay_exactly():
    import json
    import math

    for mutation in (Mutation("run.json", "set", ("world_size",), float("nan")),
                     Mutation("rank-0.json", "set", ("traceEvents", 3, "args"), {"float": 1}),
                     Mutation("rank-0.json", "nest", ("traceEvents", 0), 100_000),
                     Mutation("", "set_arg", (), "bandwidth_scale=Infinity")):
        line = json.dumps(mutation.to_json(), allow_nan=False)  # the corpus is strict JSON
        again = Mutation.from_json(json.loads(line))
        assert again.to_json() == mutation.to_json() and (again.file, again.op, again.path) == (
            mutation.file, mutation.op, mutation.path)
    assert math.isnan(Mutation.from_json(Mutation("a", "set", (), math.nan).to_json()).value)
