"""The float-GEMM choice file: a decision measured once is reused by later packs/processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import attnlab.backends.linear_pack as lp
from attnlab.backends.gemm_cache import (
    ENV_PATH,
    ChoiceFile,
    default_path,
    machine_key,
    persisted_choices,
)
from attnlab.backends.linear_pack import clear_gemm_memo, pack_linear, pick


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every measurement's (N, K, rows); few weight copies (a fast test); memo cleared."""
    clear_gemm_memo()
    calls: list[tuple[int, ...]] = []
    real = lp._measure

    def counting(n: int, k: int, rows: int, *args: object) -> dict[str, float]:
        calls.append((n, k, rows))
        return real(n, k, rows, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lp, "_measure", counting)
    monkeypatch.setattr(lp, "_MEASURE_BYTES", 1 << 16)
    yield calls
    clear_gemm_memo()


def _entries(path: Path) -> dict[str, dict[str, object]]:
    data = json.loads(path.read_text())
    assert data["version"] == 1
    (table,) = data["machines"].values()
    return dict(table)


def test_a_persisted_choice_is_reused_by_a_second_pack(
    tmp_path: Path, counted: list[tuple[int, ...]]
) -> None:
    path = tmp_path / "choices.json"
    with persisted_choices(path) as f:
        first = pack_linear(torch.randn(40, 24), rows=(1, 2))
    assert f is not None and f.writes == 2 and f.hits == 0
    assert counted == [(40, 24, 1), (40, 24, 2)]
    entries = _entries(path)
    assert set(entries) == {"40,24,0,float32,1", "40,24,0,float32,2"}
    assert entries["40,24,0,float32,2"]["chosen"] == first.choices[2].chosen
    clear_gemm_memo()  # a new process: nothing in memory
    with persisted_choices(path) as f:
        second = pack_linear(torch.randn(40, 24), rows=(2, 1))
    assert counted == [(40, 24, 1), (40, 24, 2)]  # nothing measured again
    assert f is not None and f.hits == 2 and f.writes == 0
    for b in (1, 2):
        c = second.choices[b]
        assert c.stored and c.how == "measured" and "stored" in str(c)
        assert (c.chosen, c.other_rows) == (first.choices[b].chosen, first.choices[b].other_rows)
        assert c.timings_us == pytest.approx(first.choices[b].timings_us)
    clear_gemm_memo()
    pack_linear(torch.randn(40, 24), rows=(1,))  # outside the block: measured, no file
    assert counted[-1] == (40, 24, 1)


def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(
    tmp_path: Path, counted: list[tuple[int, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING), persisted_choices(path):
        pack_linear(torch.randn(40, 24), rows=(1,))
    assert counted == [(40, 24, 1)]
    assert any(str(path) in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)
    assert set(_entries(path)) == {"40,24,0,float32,1"}  # valid JSON again


def test_an_entry_that_cannot_run_is_measured_again(
    tmp_path: Path, counted: list[tuple[int, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "choices.json"
    machine = machine_key(torch.get_num_threads())
    bad = {"chosen": "cublas", "other_rows": "linear", "timings_us": {"cublas": 1.0}}
    path.write_text(json.dumps({"version": 1, "machines": {machine: {"40,24,0,float32,1": bad}}}))
    with caplog.at_level(logging.WARNING), persisted_choices(path):
        p = pack_linear(torch.randn(40, 24), rows=(1,))
    assert counted == [(40, 24, 1)] and not p.choices[1].stored
    assert any("cannot be used here" in r.getMessage() for r in caplog.records)
    assert _entries(path)["40,24,0,float32,1"]["chosen"] == p.choices[1].chosen


def test_remeasure_ignores_the_file_and_rewrites_it(
    tmp_path: Path, counted: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "choices.json"
    with persisted_choices(path):
        pack_linear(torch.randn(40, 24), rows=(1,))
    clear_gemm_memo()
    monkeypatch.setenv("ATTNLAB_GEMM_REMEASURE", "1")
    with persisted_choices(path) as f:
        p = pack_linear(torch.randn(40, 24), rows=(1,))
    assert counted == [(40, 24, 1), (40, 24, 1)] and not p.choices[1].stored
    assert f is not None and f.remeasure and f.writes == 1


def test_other_processes_entries_are_kept_and_the_file_can_be_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sub" / "choices.json"
    a, b = ChoiceFile(path), ChoiceFile(path)  # two processes' views of one file
    entry = {"chosen": "linear", "other_rows": "linear", "timings_us": {"linear": 1.0}}
    a.put("m", "1,1,0,float32,1", entry)
    b.put("m", "2,2,0,float32,1", entry)  # merged with what a wrote
    assert set(_entries(path)) == {"1,1,0,float32,1", "2,2,0,float32,1"}
    assert not list(path.parent.glob("*.json.*"))  # no temporary file left
    assert machine_key(1) != machine_key(2)
    monkeypatch.setenv(ENV_PATH, "off")
    assert default_path() is None
    with persisted_choices() as f:
        assert f is None
    monkeypatch.setenv(ENV_PATH, str(path))
    assert default_path() == path


def test_pick_leaves_the_default_only_by_more_than_the_margin() -> None:
    assert pick({"linear": 100.0, "mm_t": 95.0, "mkl": 99.0}) == "linear"
    assert pick({"linear": 100.0, "mm_t": 80.0}) == "mm_t"
    # near-ties between the others go to the simpler layout
    assert pick({"linear": 100.0, "mm_t": 80.0, "mkl": 75.0}) == "mm_t"
    assert pick({"linear": 100.0, "mm_t": 90.0, "mkl": 60.0}) == "mkl"
    assert pick({"mm_t": 50.0, "mkldnn": 10.0}) == "mkldnn"
