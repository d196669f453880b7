"""Datasets that cannot be read (experiments/lm/hf_datasets.py, saved_dataset.py, corpus.py): a broken jsonl line, an
empty jsonl, a bad csv, a forged save_to_disk folder are each one paragraph naming the file (and line) and the fix,
exit 2, with no run folder and no `.KEY.partial-*` scratch folder left behind; a state.json naming a FIFO is refused
without being opened; a glob that walks too much is stopped at data.glob_limit entries, naming the glob and the way
on. In-process: runner.__main__.cli as tests/unit/test_bad_inputs.py runs it, TextBytes for the variants."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import deadline

from experiments.lm.corpus import bounded_glob
from experiments.lm.data import TextBytes, write_once
from runner import ConfigError
from runner.rundir import DiskFull

datasets = pytest.importorskip("datasets")
LM = ["+experiment=lm", "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16"]
LM += ["logger=none", "callbacks=none", "checkpoint=none", "trainer.max_duration=2st"]
ROWS = [json.dumps({"text": f"def f{i}():\n    return {i}\n" * 4}) for i in range(20)]


def _saved(root: Path, name: str) -> Path:
    """A save_to_disk folder of 20 rows of text."""
    folder = root / name
    datasets.Dataset.from_dict({"text": [json.loads(r)["text"] for r in ROWS]}).save_to_disk(str(folder))
    return folder


def _forge_state(folder: Path, **changes: object) -> None:
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, **changes}))


def _fifo_data_file(root: Path) -> Path:
    folder = _saved(root, "fifo")
    os.mkfifo(folder / "pipe.arrow")
    _forge_state(folder, _data_files=[{"filename": "pipe.arrow"}])
    return folder


def _device_data_file(root: Path) -> Path:
    folder = _saved(root, "device")
    (folder / "zero.arrow").symlink_to("/dev/zero")  # a link inside the folder to a device that never ends
    _forge_state(folder, _data_files=[{"filename": "zero.arrow"}])
    return folder


def _broken_jsonl(root: Path) -> Path:
    (root / "broken.jsonl").write_text("\n".join([*ROWS[:7], '{"text": "a line cut sh', *ROWS[8:]]) + "\n")
    return root / "broken.jsonl"


def _empty_jsonl(root: Path) -> Path:
    (root / "empty.jsonl").write_bytes(b"")
    return root / "empty.jsonl"


def _ragged_csv(root: Path) -> Path:
    (root / "ragged.csv").write_text("text,n\n" + "".join(f"row {i} of text,{i}\n" for i in range(30)) + "a,1,2,3\n")
    return root / "ragged.csv"


# case: (what the path is, fragments the one paragraph must hold)
CLI_CASES: dict[str, tuple[Callable[[Path], Path], list[str]]] = {
    "broken jsonl line": (_broken_jsonl, ["broken.jsonl line 8 is not JSON (Unterminated string", "one JSON object"]),
    "empty jsonl": (_empty_jsonl, ["empty.jsonl is empty (0 bytes)", "remove it, or narrow data.dataset.path"]),
    "bad csv": (_ragged_csv, ["ragged.csv cannot be read as csv", "Expected 2 fields in line 32, saw 4"]),
    "state.json naming a FIFO": (
        _fifo_data_file,
        ["fifo/pipe.arrow is not as dataset.save_to_disk writes it", "a FIFO, not a regular file", "without opening"],
    ),
    "state.json naming a device": (_device_data_file, ["device/zero.arrow is not as", "a device, not a regular file"]),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_a_dataset_that_cannot_be_read_exits_2_in_one_paragraph_leaving_nothing(
    case: str, run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, fragments = CLI_CASES[case]
    data = make(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}  # the user's data: untouched
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "earlier").mkdir(parents=True)  # an earlier run's folder: kept
    cache = tmp_path / "cache"
    for where in ([], [f"hydra.run.dir={tmp_path / 'new' / 'run'}"]):  # outputs/DATE/TIME, and a named new folder
        code, err = run_cli(*LM, f"data.dataset={data}", f"data.cache_dir={cache}", *where)
        assert code == 2, err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        for fragment in fragments:
            assert fragment in err, err
        assert f"data.dataset.path={data}" in err or f"data.dataset.path: {data}" in err, err
        assert not (tmp_path / "new").exists() and [p.name for p in (tmp_path / "outputs").iterdir()] == ["earlier"]
        assert not cache.exists() or list(cache.iterdir()) == []  # no .KEY.partial-* scratch folder
    assert {p: p.read_bytes() for p in before} == before


# ---- the variants, through the data module ---------------------------------------------------------------------
def _write(root: Path, name: str, data: bytes | str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _files(root: Path) -> dict[str, tuple[Path | str, list[str]]]:
    """Each bad input: (its path or glob, fragments of the message)."""
    good = "\n".join(ROWS) + "\n"
    for i in range(3):
        _write(root, f"shards/{i}.jsonl", good)
    _write(root, "shards/3.jsonl", "\n".join([*ROWS[:4], '{"text": "cut', *ROWS]) + "\n")
    return {
        "a line that is a list": (
            _write(root, "list.jsonl", "\n".join([*ROWS[:3], "[1, 2]", *ROWS[3:]]) + "\n"),
            ["list.jsonl line 4 is a JSON list, not an object"],
        ),
        "a line that is not UTF-8": (
            _write(root, "latin.jsonl", good.encode() + '{"text": "café"}\n'.encode("latin-1")),
            ["latin.jsonl line 21 is not UTF-8 text (at byte 14 of the line)", "convert the file"],
        ),
        "a csv that is not UTF-8": (
            _write(root, "latin.csv", "text\nnaïve\n".encode("latin-1")),
            ["latin.csv line 2 is not UTF-8 text"],
        ),
        "a csv with an open quote": (
            _write(root, "quote.csv", 'text\n"never closed\n'),
            ["quote.csv cannot be read as csv", "EOF inside string"],
        ),
        "a parquet that is not one": (
            _write(root, "noise.parquet", np.random.default_rng(0).bytes(2000)),
            ["noise.parquet cannot be read as parquet", "magic bytes"],
        ),
        "one bad shard of four": (str(root / "shards" / "*.jsonl"), ["shards/3.jsonl line 5 is not JSON"]),
        "a FIFO named as a data file": (_fifo(root / "pipe.jsonl"), ["pipe.jsonl is a FIFO, not a regular file"]),
        "an empty shard among good ones": (
            _empty_among(root),
            ["mixed/b.jsonl is empty (0 bytes)", "narrow data.dataset.path"],
        ),
    }


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _empty_among(root: Path) -> str:
    _write(root, "mixed/a.jsonl", "\n".join(ROWS) + "\n")
    _write(root, "mixed/b.jsonl", b"")
    return str(root / "mixed" / "*.jsonl")


def _folders(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """Each forged save_to_disk folder: (the folder, fragments of the message)."""
    cases = {}

    def forged(name: str, fragments: list[str], **changes: object) -> None:
        folder = _saved(root, name)
        _forge_state(folder, **changes)
        cases[name] = (folder, fragments)

    forged("a device", ["names the data file '/dev/zero', not a file in"], _data_files=[{"filename": "/dev/zero"}])
    forged("outside", ["names the data file '../victim/x.arrow'"], _data_files=[{"filename": "../victim/x.arrow"}])
    forged("no files", ["lists no data files (_data_files"], _data_files="data.arrow")
    forged("missing file", ["gone.arrow is not as", "(it is missing)"], _data_files=[{"filename": "gone.arrow"}])
    forged("a column that is not there", ["datasets cannot read the save_to_disk folder"], _format_columns=["nope"])
    folder = _saved(root, "not JSON")
    (folder / "state.json").write_text("{'single': 'quotes'}")
    cases["not JSON"] = (folder, ["state.json is not as dataset.save_to_disk writes it (it is not readable JSON"])
    folder = _saved(root, "too deep")
    (folder / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    cases["too deep"] = (folder, ["it is not readable JSON (maximum recursion depth"])
    folder = _saved(root, "state FIFO")
    (folder / "state.json").unlink()
    os.mkfifo(folder / "state.json")
    cases["state FIFO"] = (folder, ["state FIFO/state.json is not as", "a FIFO, not a regular file"])
    folder = _saved(root, "info FIFO")
    (folder / "dataset_info.json").unlink()
    os.mkfifo(folder / "dataset_info.json")
    cases["info FIFO"] = (folder, ["dataset_info.json is not as", "a FIFO, not a regular file"])
    folder = _saved(root, "noise")
    next(folder.glob("*.arrow")).write_bytes(np.random.default_rng(1).bytes(4000))
    cases["noise"] = (folder, ["datasets cannot read the save_to_disk folder", "write the dataset again"])
    splits = root / "splits"
    table = datasets.Dataset.from_dict({"text": ["x " * 40] * 10})
    datasets.DatasetDict({"train": table}).save_to_disk(str(splits))
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["../outside", "train"]}))
    cases["splits"] = (splits, ["dataset_dict.json is not as", "its splits are ['../outside', 'train']"])
    return cases


def test_each_bad_data_file_is_named_with_its_line_and_the_fix(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for case, (path, fragments) in _files(tmp_path / "data").items():
        with pytest.raises(ConfigError) as caught, deadline():
            TextBytes(seq_len=16, dataset=str(path), cache_dir=str(cache), batch_size=4)
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"data.dataset.path={path}"), (case, message)
        for fragment in fragments:
            assert fragment in message, (case, message)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_a_forged_save_to_disk_folder_is_refused_before_anything_is_opened(tmp_path: Path) -> None:
    victim = _write(tmp_path / "victim", "x.arrow", b"never read")
    cache = tmp_path / "cache"
    for case, (folder, fragments) in _folders(tmp_path).items():
        with pytest.raises(ConfigError) as caught, deadline():
            TextBytes(seq_len=16, dataset={"path": str(folder)}, cache_dir=str(cache), batch_size=4)
        message = str(caught.value)
        assert "\n" not in message and "write the dataset again with dataset.save_to_disk(DIR)" in message, message
        for fragment in fragments:
            assert fragment in message, (case, message)
    assert victim.read_bytes() == b"never read"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_a_save_to_disk_folder_reads_whatever_format_its_state_asks(tmp_path: Path) -> None:
    # a state.json asking for numpy rows is read as text all the same: the format is not the data's
    plain, numpy = _saved(tmp_path, "plain"), _saved(tmp_path, "numpy")
    _forge_state(numpy, _format_type="numpy")
    options = {"seq_len": 16, "val_every": 5, "cache_dir": str(tmp_path / "cache"), "batch_size": 4}
    a, b = TextBytes(dataset=str(plain), **options), TextBytes(dataset=str(numpy), **options)
    assert np.array_equal(np.asarray(a.splits["train"].tokens), np.asarray(b.splits["train"].tokens))
    assert a.info["corpus"]["rows"] == 20


# ---- globs: bounded work ----------------------------------------------------------------------------------------
def _tree(root: Path, folders: int = 30, files: int = 5) -> Path:
    for f in range(folders):
        for i in range(files):
            _write(root, f"part-{f:02d}/deep/{i}.jsonl", "\n".join(ROWS[:2]) + "\n")
    _write(root, ".hidden/0.jsonl", "\n".join(ROWS[:2]) + "\n")
    (root / "part-00" / "loop").symlink_to(root)  # a link back up: glob follows it; the cap ends the walk
    return root


def test_bounded_glob_finds_what_glob_finds(tmp_path: Path) -> None:
    root = _tree(tmp_path / "tree", folders=3)
    stdlib = sysconfig.get_paths()["stdlib"]
    patterns = [f"{root}/*/deep/*.jsonl", f"{root}/part-0[12]/**/*.jsonl", f"{root}/.*/*", f"{root}/*"]
    patterns += [f"{stdlib}/json/*.py", f"{stdlib}/json/**", f"{stdlib}/*/__init__.py", f"{root}/nosuch/*"]
    for pattern in patterns:
        assert sorted(bounded_glob(pattern, 10**6, "o", "o.limit")) == sorted(
            map(Path, glob.glob(pattern, recursive=True))
        ), pattern


@pytest.mark.parametrize("option", ["data.paths", "data.dataset"])
def test_a_glob_that_walks_too_much_stops_at_the_limit_naming_it(option: str, tmp_path: Path) -> None:
    root = _tree(tmp_path / "tree")
    pattern = f"{root}/**/*.jsonl"
    common = {"seq_len": 16, "cache_dir": str(tmp_path / "cache"), "batch_size": 4, "val_every": 0}

    def make(limit: int) -> TextBytes:
        if option == "data.paths":
            return TextBytes(paths=[pattern], glob_limit=limit, **common)
        return TextBytes(dataset={"path": pattern, "glob_limit": limit}, **common)

    with pytest.raises(ConfigError) as caught, deadline():
        make(100)
    message = str(caught.value)
    assert message.startswith(option), message
    assert f"the glob '{pattern}' looked at more than 100 files and folders" in message, message
    limit = "data.glob_limit" if option == "data.paths" else "data.dataset.glob_limit"
    assert f"raise {limit} (now 100)" in message and "start it at the data's own folder" in message, message
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_a_transformers_source_s_glob_is_named_by_its_own_options(tmp_path: Path) -> None:
    from experiments.lm.corpus import corpus_files

    pattern = f"{_tree(tmp_path / 'tree')}/**/*.jsonl"
    with pytest.raises(ConfigError) as caught, deadline():
        corpus_files([pattern], 2, 100, "source.inputs")
    message = str(caught.value)
    assert message.startswith("source.inputs.paths: the glob") and "raise source.inputs.glob_limit (now 100)" in message


def test_a_glob_looks_at_no_more_entries_than_its_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.lm import corpus

    root, seen, scandir = _tree(tmp_path / "tree"), [], os.scandir

    @contextlib.contextmanager
    def counted(folder: Path) -> Iterator[Iterator[os.DirEntry]]:
        with scandir(folder) as entries:
            yield (seen.append(entry) or entry for entry in entries)

    class CountingOs:  # corpus's own `os`: the rest of the process keeps the real scandir
        scandir = staticmethod(counted)

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

    monkeypatch.setattr(corpus, "os", CountingOs())
    with pytest.raises(ConfigError, match="looked at more than 500 files"):
        bounded_glob(f"{root}/**/*.parquet", 500, "data.paths", "data.glob_limit")
    assert len(seen) == 501
    seen.clear()
    assert len(bounded_glob(f"{root}/part-00/deep/*.jsonl", 500, "data.paths", "data.glob_limit")) == 5
    assert len(seen) == 5  # a literal folder is not walked: only its own entries are looked at


def test_a_glob_inside_its_limit_reads_every_file(tmp_path: Path) -> None:
    root = _tree(tmp_path / "tree", folders=4)
    (root / "part-00" / "loop").unlink()
    data = TextBytes(
        dataset={"path": f"{root}/*/deep/*.jsonl", "glob_limit": 100},
        seq_len=16,
        cache_dir=str(tmp_path / "cache"),
        batch_size=4,
        val_every=0,
    )
    assert data.info["corpus"]["rows"] == 4 * 5 * 2  # 20 files of 2 rows; the hidden folder's left out, as by glob


@pytest.mark.parametrize("kind", ["text_bytes", "text_stream"])
def test_a_fifo_in_data_paths_is_refused_without_opening_it(kind: str, tmp_path: Path) -> None:
    from experiments.lm.stream import TextStream

    os.mkfifo(tmp_path / "pipe.txt")
    data = TextBytes if kind == "text_bytes" else TextStream
    with pytest.raises(ConfigError) as caught, deadline():
        data(seq_len=16, paths=[str(tmp_path / "*.txt")], batch_size=4, val_every=0)
    pipe = tmp_path / "pipe.txt"
    assert (
        str(caught.value)
        == f"data.paths: {pipe} is a FIFO, not a regular file; refused without opening it: name text files"
    )


@pytest.mark.parametrize("limit", [0, -1, 2.5, "many"])
def test_a_glob_limit_that_is_not_a_whole_number_is_refused(limit: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="glob_limit must be a whole number >= 1"):
        TextBytes(seq_len=16, paths=[f"{tmp_path}/*.txt"], glob_limit=limit, batch_size=4)
    with pytest.raises(ConfigError, match=r"data.dataset.glob_limit must be a whole number >= 1"):
        TextBytes(seq_len=16, dataset={"path": f"{tmp_path}/*.jsonl", "glob_limit": limit}, batch_size=4)


# ---- the encoding cache: a refused or interrupted encoding leaves no scratch folder -----------------------------
@pytest.mark.parametrize(
    "failure",
    [ConfigError("a refused row"), KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")],
    ids=["refused", "ctrl-c", "disk-full"],
)
def test_an_encoding_that_fails_leaves_the_cache_as_it_was(failure: BaseException, tmp_path: Path) -> None:
    kept = tmp_path / "cache" / "0123456789abcdef"  # another corpus's finished cache: untouched
    _write(kept, "meta.json", "{}")

    def fill(scratch: Path) -> None:
        (scratch / "train.u8").write_bytes(b"half written")
        raise failure

    expected = DiskFull if isinstance(failure, OSError) else type(failure)
    with pytest.raises(expected) as caught:
        write_once(tmp_path / "cache" / "fedcba9876543210", fill, "data.cache_dir")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [kept.name]
    assert (kept / "meta.json").read_text() == "{}"
    if expected is DiskFull:
        message = str(caught.value)
        assert message.startswith(f"disk full: writing the cache {tmp_path / 'cache' / 'fedcba9876543210'} failed")
        assert "nothing was left in the cache" in message and "data.cache_dir=DIR" in message, message


def test_a_dataset_refused_half_way_leaves_no_scratch_folder(tmp_path: Path) -> None:
    # the rows before the bad one were written into the scratch folder already
    path = _write(tmp_path, "late.jsonl", "\n".join([*ROWS, *ROWS, '{"text": "a\\u0000b"}']) + "\n")
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match="row 40 holds a NUL character"):
        TextBytes(seq_len=16, dataset={"path": str(path)}, cache_dir=str(cache), batch_size=4)
    assert list(cache.iterdir()) == []
