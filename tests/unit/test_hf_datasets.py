"""Hugging Face datasets on disk as text (experiments/lm/hf_datasets.py): data=text_bytes and a transformers source's
inputs read a save_to_disk folder, parquet or jsonl files to the very windows the same rows give as files (so the
held-out split and resume are the files'), and a dataset without its text column, a hub name or a mixed folder is
refused by name before anything is written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import HF_TEXT, hf_text, tiny_hf_model

from experiments.lm.data import TextBytes
from experiments.sae.sources.source import SourceModel
from runner import ConfigError

datasets = pytest.importorskip("datasets")
ROWS = [f"def f{i}():\n    return {i} * 'x'\n" * (3 + i % 4) for i in range(40)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same 40 rows as a save_to_disk folder, a parquet file, a jsonl file and 40 text files."""
    root = tmp_path_factory.mktemp("ds")
    table = datasets.Dataset.from_dict({"content": ROWS, "n": list(range(40))})
    table.save_to_disk(str(root / "disk"))
    table.to_parquet(str(root / "rows.parquet"))
    table.to_json(str(root / "rows.jsonl"))
    (root / "files").mkdir()
    for i, text in enumerate(ROWS):
        (root / "files" / f"{i:03d}.py").write_text(text)
    return root


def _bytes(data: TextBytes, split: str) -> np.ndarray:
    windows = data.splits[split]
    return np.asarray(windows.tokens)


@pytest.mark.parametrize("path", ["disk", "rows.parquet", "rows.jsonl", "*.parquet"])
def test_a_dataset_gives_the_windows_its_rows_give_as_files(written: Path, path: str, tmp_path: Path) -> None:
    options = {"seq_len": 16, "val_every": 5, "cache_dir": str(tmp_path / "cache"), "batch_size": 4}
    files = TextBytes(paths=[str(written / "files" / "*.py")], **options)
    rows = TextBytes(dataset={"path": str(written / path), "text_column": "content"}, **options)
    for split in ("train", "val"):
        assert np.array_equal(_bytes(rows, split), _bytes(files, split)), split
    assert rows.info["corpus"]["rows"] == 40 and rows.info["corpus"]["val_rows"] == 8
    # read again: from the cache, named by the dataset's files
    again = TextBytes(dataset={"path": str(written / path), "text_column": "content"}, **options)
    assert again.info["corpus"]["cache"] == rows.info["corpus"]["cache"]


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"path": "disk", "text_column": "text"}, "text_column=text: the dataset's columns are ['content', 'n']"),
        ({"path": "rows.jsonl", "text_column": "n"}, "text_column=n: row 0 holds int, not text"),
        ({"path": "nosuch/corpus"}, "names no local file or folder"),
        ({"path": "files"}, "not one written by save_to_disk"),
        ({"path": "*"}, "files of one kind"),
        ({"path": "disk", "colum": "x"}, "unknown key(s) ['colum']"),
    ],
)
def test_a_dataset_that_cannot_be_read_is_refused_by_name(written, dataset, message, tmp_path: Path) -> None:
    dataset = {**dataset, "path": str(written / dataset["path"])}
    with pytest.raises(ConfigError, match=re.escape(message)):
        TextBytes(seq_len=16, dataset=dataset, cache_dir=str(tmp_path / "cache"), batch_size=4)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache" / "text_bytes").glob("[!.]*"))


def test_a_hub_name_is_not_fetched(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reads datasets from disk only"):
        TextBytes(seq_len=16, dataset="HuggingFaceFW/fineweb", cache_dir=str(tmp_path), batch_size=4)


def test_a_transformers_source_reads_a_dataset_as_its_files(tmp_path: Path) -> None:
    model = tiny_hf_model(tmp_path / "model", "gpt2")
    paths = hf_text(tmp_path / "text", copies=2)
    table = datasets.Dataset.from_dict({"text": [Path(p).read_text() for p in paths]})
    table.save_to_disk(str(tmp_path / "disk"))
    common = {"context": 16, "val_every": 2, "cache_dir": str(tmp_path / "cache")}
    from_files = SourceModel(str(model), "transformer.h.0", inputs={"paths": paths, **common})
    from_rows = SourceModel(str(model), "transformer.h.0", inputs={"dataset": str(tmp_path / "disk"), **common})
    for split in ("train", "val"):
        a, b = from_files.data.splits[split], from_rows.data.splits[split]
        assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)), split
    assert len(HF_TEXT) > 0


def test_the_cli_refuses_a_dataset_without_its_text_column(written: Path, compose_cfg, tmp_path: Path) -> None:
    from runner.train import train

    cfg = compose_cfg("+experiment=lm", f"data.dataset={{path: {written / 'disk'}}}", f"data.cache_dir={tmp_path}")
    with pytest.raises(ConfigError, match=re.escape("data.dataset.text_column=text: the dataset's columns are")):
        train(cfg)
    assert not (tmp_path / "run").exists()
