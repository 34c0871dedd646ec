"""Class 6 of the hardening issue: a damaged model folder raises ``ModelFileError`` (a
``ValueError``) naming the file and the fault, whatever the damage.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab.errors import ModelFileError
from attnlab.models import DecoderConfig, DecoderLM


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = DecoderLM(
        DecoderConfig.llama(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16,
        )
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("good")
    attnlab.to_hf(model).save_pretrained(folder)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, edit: Callable[[dict], object]) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(edit(cfg)))


def _shard(folder: Path, index: object) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _rope_zero(cfg: dict) -> dict:
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 0
    return cfg


DAMAGE: dict[str, tuple[Callable[[Path], object], str, str]] = {
    # name: (damage, file named in the message, fault named in the message)
    "empty weights": (
        lambda f: (f / "model.safetensors").write_bytes(b""), "model.safetensors", "empty"
    ),
    "truncated weights": (
        lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-9]),
        "model.safetensors",
        "truncated",
    ),
    "corrupt header": (
        lambda f: (f / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not json at all!" * 4),
        "model.safetensors",
        "corrupt",
    ),
    "huge header length": (
        lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}"),
        "model.safetensors",
        "claims",
    ),
    "config is a list": (lambda f: _edit_config(f, lambda c: [c]), "config.json", "list"),
    "config lacks vocab_size": (
        lambda f: _edit_config(f, lambda c: {k: v for k, v in c.items() if k != "vocab_size"}),
        "config.json",
        "'vocab_size'",
    ),
    "config malformed": (
        lambda f: (f / "config.json").write_text('{"model_type": "llama",'),
        "config.json",
        "malformed JSON at line 1",
    ),
    "config without model_type": (
        lambda f: _edit_config(f, lambda c: {k: v for k, v in c.items() if k != "model_type"}),
        "config.json",
        "model_type",
    ),
    "rope_theta 0": (lambda f: _edit_config(f, _rope_zero), "config.json", "rope_theta"),
    "num_attention_heads 0": (
        lambda f: _edit_config(f, lambda c: c | {"num_attention_heads": 0}),
        "config.json",
        "",
    ),
    "no config": (lambda f: (f / "config.json").unlink(), "config.json", "has no"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "model.safetensors", "has no"),
    "index without weight_map": (
        lambda f: _shard(f, {"metadata": {}}), "model.safetensors.index.json", "weight_map"
    ),
    "index naming a missing shard": (
        lambda f: _shard(f, {"weight_map": {"lm_head.weight": "model-00009.safetensors"}}),
        "model.safetensors.index.json",
        "does not hold",
    ),
    "shard leaving the folder": (
        lambda f: _shard(f, {"weight_map": {"lm_head.weight": "../../outside.safetensors"}}),
        "model.safetensors.index.json",
        "outside the model folder",
    ),
    "absolute shard path": (
        lambda f: _shard(f, {"weight_map": {"lm_head.weight": "/etc/hostname"}}),
        "model.safetensors.index.json",
        "outside the model folder",
    ),
    "index is a list": (lambda f: _shard(f, []), "model.safetensors.index.json", "list"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_folders_name_the_file_and_the_fault(
    case: str, good_folder: Path, tmp_path: Path
) -> None:
    damage, file, fault = DAMAGE[case]
    folder = _copy(good_folder, tmp_path / "m")
    damage(folder)
    with pytest.raises(ModelFileError) as info:
        attnlab.from_hf(folder)
    msg = str(info.value)
    assert file in msg and fault in msg, msg
    assert isinstance(info.value, ValueError)


def test_a_missing_folder_is_a_model_file_error(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        attnlab.from_hf(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelFileError, match="is not a folder"):
        attnlab.from_hf(tmp_path / "file")


def test_any_truncation_or_header_damage_is_a_model_file_error(
    good_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    data = (good_folder / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")

    @settings(max_examples=25)
    @given(
        cut=st.integers(0, len(data) - 1),
        flip=st.tuples(st.integers(0, header_end - 1), st.integers(1, 255)) | st.none(),
    )
    def check(cut: int, flip: tuple[int, int] | None) -> None:
        folder = _copy(good_folder, tmp_path_factory.mktemp("damaged") / "m")
        damaged = bytearray(data)
        if flip is None:
            damaged = damaged[:cut]
        else:
            damaged[flip[0]] ^= flip[1]
        (folder / "model.safetensors").write_bytes(bytes(damaged))
        try:
            attnlab.from_hf(folder)
        except ModelFileError as e:
            assert "model.safetensors" in str(e) or str(folder) in str(e), str(e)
        # a flip inside a tensor name's padding may leave a loadable file: that is fine

    check()


def test_the_good_folder_loads(good_folder: Path) -> None:
    model = attnlab.from_hf(good_folder)
    assert model.config.vocab_size == 32
