"""Every seed a user gives is range-checked by one validator (:func:`check_seed`), where it
enters: configs, the commands' ``--seed`` and ``--set seed=``, experiments. Torch's own
"Overflow when unpacking long long" never shows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab._validate import SEED_MAX, check_seed, derive_seed
from attnlab.cli.main import main

BAD_SEEDS: list[Any] = [
    -1,
    SEED_MAX + 1,
    2**64,
    2**64 - 1,
    True,
    False,
    1.0,
    "3",
    None,
    float("nan"),
]


@pytest.mark.parametrize("bad", BAD_SEEDS, ids=repr)
def test_check_seed_refuses_and_names_the_argument(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"my_seed must be an int in \[0, 9223372036854775807\]"):
        check_seed("my_seed", bad)


@given(st.integers(min_value=0, max_value=SEED_MAX))
def test_every_accepted_seed_seeds_torch_with_an_offset(seed: int) -> None:
    assert check_seed("seed", seed) == seed
    torch.Generator().manual_seed(seed + 16)  # a request's choice i is seeded seed + i
    torch.Generator().manual_seed(derive_seed(seed, 2**70, 3))


def test_derive_seed_matches_the_old_mix_for_small_seeds() -> None:
    # data order and synthetic batches keep their streams (exact resume of old runs)
    assert derive_seed(7, 11) == 7 * 1_000_003 + 11
    assert derive_seed(SEED_MAX, 1) < 2**63


@pytest.mark.parametrize("bad", [-1, SEED_MAX + 1, True, 2.0])
def test_configs_check_their_seed(bad: Any) -> None:
    from attnlab.train.config import TrainConfig
    from attnlab.train.distill import DistillConfig

    with pytest.raises(ValueError, match="seed must be an int in"):
        TrainConfig(seed=bad)
    with pytest.raises(ValueError, match="DistillConfig.seed must be an int in"):
        DistillConfig(seed=bad)


def test_run_experiment_checks_its_seed(tmp_path: Any) -> None:
    from attnlab.experiments import run_experiment

    with pytest.raises(ValueError, match="seed must be an int in"):
        run_experiment("induction", smoke=True, out=tmp_path, seed=2**64)


CLI_CASES = [
    ["train", "--preset", "copy", "--set", f"seed={2**64}", "--out", "{tmp}"],
    ["train", "--preset", "copy", "--set", "seed=-3", "--out", "{tmp}"],
    ["distill", "--seed", str(2**64), "--out", "{tmp}"],
    ["experiment", "induction", "--seed", str(2**63), "--out", "{tmp}"],
    ["generate", "--random", "gpt2", "--ids", "1", "--seed", "-1"],
]


@pytest.mark.parametrize("argv", CLI_CASES, ids=lambda a: " ".join(a[:2]))
def test_cli_seeds_exit_2_naming_the_seed(
    argv: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(tmp=tmp_path / "out") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "seed" in err and "must be" in err and "Overflow" not in err, err
    assert "Traceback" not in err
