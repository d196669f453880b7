"""Bad values and bad files that were accepted silently, failed with a traceback, or said something misleading: each is
now refused as a configuration error (exit 2) whose one paragraph names the key or the file and what to type instead.
In-process, as tests/unit/test_cli_errors.py; the CLI itself (hydra.run.dir, threads) through runner.__main__.cli."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from runner import ConfigError
from runner.sweeps.job import threads_per_job
from runner.train import train

JSON_PY = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
# a tiny GPT on one stdlib file; the cases below add their data
LM = ["+experiment=lm", "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16"]
LM += ["logger=none", "callbacks=none", "checkpoint=none", "trainer.max_duration=2st"]
DIGITS = ["+experiment=digits", "logger=none"]

# id: (overrides, fragments the message must contain); {tmp} is the folder of the files bad_files() writes
CASES: dict[str, tuple[list[str], list[str]]] = {
    # silently accepted before
    "warmup-longer-than-the-run": (
        [*DIGITS, "scheduler=cosine", "scheduler.warmup=100ep", "trainer.max_duration=2ep"],
        ["scheduler.warmup=100ep is 4500 optimizer steps", "longer than the whole run", "90 steps", "0.05dur"],
    ),
    "warmup-and-decay-longer-than-the-run": (
        [*DIGITS, "scheduler=wsd", "scheduler.warmup=0.6dur", "scheduler.decay=0.6dur"],
        ["scheduler.warmup=0.6dur", "scheduler.decay=0.6dur", "longer than the whole run"],
    ),
    "min-lr-ratio-above-one": (
        [*DIGITS, "scheduler=cosine", "scheduler.min_lr_ratio=2"],
        ["scheduler.min_lr_ratio must be in [0, 1]", "got 2", "scheduler.min_lr_ratio=0.1"],
    ),
    "min-lr-ratio-negative": (
        ["+experiment=sae", "logger=none", "scheduler.min_lr_ratio=-0.5"],
        ["scheduler.min_lr_ratio must be in [0, 1]", "got -0.5"],
    ),
    "zero-width-hidden-layer": ([*DIGITS, "model.hidden=[0]"], ["model.hidden=[0]", "whole number >= 1"]),
    "non-utf8-text-stream": (
        [*LM, "data=text_stream", "data.paths=[{tmp}/latin1.txt]"],
        ["latin1.txt is not UTF-8 text (byte 2 is not valid UTF-8)", "data=text_stream"],
    ),
    # tracebacks (exit 1) before
    "huge-lr": ([*DIGITS, "optimizer.lr=1e99"], ["optimizer.lr must be a finite number in [0, 1e+30]", "got 1e+99"]),
    "infinite-lr": ([*DIGITS, "optimizer.lr=inf"], ["optimizer.lr", "got inf", "optimizer.lr=3e-4"]),
    "betas-above-one": (
        [*DIGITS, "optimizer=adamw", "optimizer.betas=[2,3]"],
        ["optimizer.betas must be two numbers in [0, 1)", "got [2,3]", "optimizer.betas=[0.9,0.999]"],
    ),
    "one-beta": ([*DIGITS, "optimizer=adamw", "optimizer.betas=[0.9]"], ["optimizer.betas must be two numbers"]),
    "negative-weight-decay": (
        [*DIGITS, "optimizer.weight_decay=-1"],
        ["optimizer.weight_decay must be a finite number >= 0, got -1", "optimizer.weight_decay=0.01"],
    ),
    "nesterov-without-momentum": (
        [*DIGITS, "optimizer=sgd", "optimizer.momentum=0"],
        ["optimizer.nesterov=true needs optimizer.momentum > 0"],
    ),
    "dropout-above-one": ([*DIGITS, "model.dropout=1.5"], ["model.dropout must be in [0, 1)", "got 1.5"]),
    "plateau-factor-above-one": ([*DIGITS, "scheduler.factor=2"], ["scheduler.factor must be in (0, 1)"]),
    "empty-text-file": ([*LM, "data.paths=[{tmp}/empty.txt]"], ["training text is empty", "empty.txt"]),
    "empty-text-file-streamed": (
        [*LM, "data=text_stream", "data.paths=[{tmp}/empty.txt]"],
        ["training files are empty", "empty.txt"],
    ),
    "empty-tokens-bin": (
        [*LM, "data=tokens_file", "data.train_path={tmp}/empty.bin"],
        ["tokens file", "empty.bin is empty (0 bytes)"],
    ),
    "odd-sized-tokens-bin": (
        [*LM, "data=tokens_file", "data.train_path={tmp}/odd.bin"],
        ["odd.bin is 3 bytes, not a whole number of uint16 ids (2 bytes each)", "data.dtype"],
    ),
    "zero-seq-len": ([*LM, f"data.paths=[{JSON_PY}]", "model.seq_len=0"], ["model.seq_len", "got 0"]),
    # a wrong type for a key, wherever it is: named, with the type it needs
    "text-for-a-number": ([*DIGITS, "model.dropout=abc"], ["model.dropout must be a number, got 'abc' (str)"]),
    "list-for-a-number": (
        [*DIGITS, "trainer.gradient_clip_val=[1,2]"],
        ["trainer.gradient_clip_val must be a number or null, got [1,2]"],
    ),
    "null-for-a-count": (
        [*DIGITS, "model.num_classes=null"],
        ["model.num_classes is not set (null): give a whole number"],
    ),
    # a preset's placeholder the user did not fill: said before the model loads (minutes for a hub model)
    "transformers-source-without-its-module": (
        ["+experiment=sae_hf", "source.checkpoint=hf:gpt2"],
        ["source.module is not set (null): give a string or a list of strings on the command line, source.module="],
    ),
    "unknown-target": ([*DIGITS, "model._target_=nope.Nothing"], ["model._target_=nope.Nothing cannot be imported"]),
    # unclear messages before
    "folder-as-tokens-file": (
        [*LM, "data=tokens_file", "data.train_path={tmp}/tokens"],
        ["tokens file", "tokens is a folder"],
    ),
    "folder-as-text-paths": ([*LM, "data.paths=[{tmp}/tokens]"], ["data.paths", "names only folders"]),
    "random-bytes-as-npy": (
        ["+experiment=sae", "logger=none", "data=activations_file", "data.train_path={tmp}/random.npy"],
        ["random.npy cannot be read: it is not a valid .npy file"],
    ),
    # accepted before: a NaN clip made every weight NaN; inf clipped nothing; keep_best=-1 was read as 0, top=-1 as
    # "all layers but the last"
    "nan-gradient-clip": (
        [*DIGITS, "trainer.gradient_clip_val=nan"],
        ["trainer.gradient_clip_val must be > 0 or null (off), got nan", "e.g. trainer.gradient_clip_val=1.0"],
    ),
    "infinite-gradient-clip": ([*DIGITS, "trainer.gradient_clip_val=inf"], ["gradient_clip_val must be > 0", "inf"]),
    "zero-gradient-clip": ([*DIGITS, "trainer.gradient_clip_val=0"], ["gradient_clip_val must be > 0", "got 0"]),
    "negative-keep-best": (
        [*DIGITS, "checkpoint.keep_best=-1"],
        ["checkpoint.keep_best must be >= 0", "got -1", "checkpoint.keep_best=3"],
    ),
    "negative-health-top": (
        [*DIGITS, "callbacks=[health]", "callbacks.health.top=-1"],
        ["callbacks.health.top must be a whole number >= 0, got -1"],
    ),
    # tracebacks before: torch.manual_seed overflowed; OmegaConf raised from deep inside the first read of the key
    "seed-past-64-bits": (
        [*DIGITS, "seed=18446744073709551616"],
        ["seed must be a whole number in [0, 4294967295]", "got 18446744073709551616", "seed=0"],
    ),
    "seed-past-32-bits": ([*DIGITS, "seed=4294967296"], ["seed must be a whole number in [0, 4294967295]"]),
    "unset-environment-variable": (
        [*DIGITS, "optimizer.lr=${{oc.env:RUNNER_UNSET_FOR_TESTS}}"],  # (str.format: {{ is {)
        [
            "optimizer.lr=${oc.env:RUNNER_UNSET_FOR_TESTS}: the environment variable RUNNER_UNSET_FOR_TESTS is not set",
            "${oc.env:RUNNER_UNSET_FOR_TESTS,default}",
        ],
    ),
    "unset-environment-variable-in-a-list": (
        [*DIGITS, "model.hidden=[${{oc.env:RUNNER_UNSET_FOR_TESTS}}]"],
        ["model.hidden.0=${oc.env:RUNNER_UNSET_FOR_TESTS}: the environment variable"],
    ),
    "interpolation-of-no-key": (
        [*DIGITS, "optimizer.lr=${{nope.lr}}"],
        ["optimizer.lr=${nope.lr} cannot be resolved (nope.lr is not a key of the config)", "--cfg job"],
    ),
    "unknown-resolver": ([*DIGITS, "optimizer.lr=${{nope:1}}"], ["there is no resolver 'nope'", "oc.env"]),
}


@pytest.fixture
def bad_files(tmp_path: Path) -> Path:
    """A folder of bad data files: latin-1 text, an empty text file, empty and odd-sized .bin, a folder named like a
    tokens file, random bytes named .npy."""
    folder = tmp_path / "files"
    (folder / "tokens").mkdir(parents=True)
    (folder / "latin1.txt").write_bytes("naïve café ".encode("latin-1") * 10)
    (folder / "empty.txt").write_bytes(b"")
    (folder / "empty.bin").write_bytes(b"")
    (folder / "odd.bin").write_bytes(b"\x01\x02\x03")
    (folder / "random.npy").write_bytes(np.random.default_rng(0).bytes(1000))
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_one_paragraph_naming_the_key_and_the_fix(
    case: str, compose_cfg: Callable, bad_files: Path, tmp_path: Path
) -> None:
    overrides, fragments = CASES[case]
    with pytest.raises(ConfigError) as caught:
        train(compose_cfg(*(o.format(tmp=bad_files) for o in overrides)))
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    assert len(message.splitlines()) <= 2, message
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_data_paths_given_as_one_string_is_one_path(built: Callable) -> None:
    # data.paths=file.py read as a list of its characters ('/' matches no file)
    _, run = built(*LM, f"data.paths={JSON_PY}", "data.val_every=0")
    assert run.settings.data_info["corpus"]["files"] == 1


@pytest.mark.parametrize("threads", [0, -3, 2.5, "abc"])
def test_threads_that_torch_would_refuse_are_a_config_error(threads: object) -> None:
    with pytest.raises(ConfigError, match=r"threads must be a whole number >= 1, or null .*e\.g\. threads=4"):
        threads_per_job(threads, 1)


def test_more_threads_than_the_machine_s_cores_are_a_config_error() -> None:
    # threads=5000 trained at 5 samples/s, threads=100000 segfaulted (exit 139)
    cores = os.cpu_count()
    assert threads_per_job(cores, 1) == cores  # one per logical core: still a choice to make
    for threads in (cores + 1, 5000, 100000):
        with pytest.raises(ConfigError, match=rf"threads={threads} is more than this machine's {cores} logical CPU"):
            threads_per_job(threads, 1)


def test_encode_corpus_given_one_path_as_a_string_encodes_that_file(tmp_path: Path) -> None:
    # a str was iterated as a list of one-character paths (an AttributeError on the first)
    from experiments.lm.data import encode_corpus

    folder, facts = encode_corpus(str(JSON_PY), 0, cache_dir=str(tmp_path))
    assert facts["files"] == 1 and (folder / "train.u8").read_bytes() == JSON_PY.read_bytes()
    assert encode_corpus(JSON_PY, 0, cache_dir=str(tmp_path))[0] == folder  # a Path: the same one file
    assert encode_corpus([str(JSON_PY)], 0, cache_dir=str(tmp_path))[0] == folder


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        ("a file", "(it is a file, not a folder): hydra.run.dir must name a folder you can write"),
        ("a folder under a file", "(Not a directory): hydra.run.dir must name a folder you can write"),
        ("/proc/x", "cannot make the run folder /proc/x ("),
    ],
)
def test_a_run_folder_that_cannot_be_made_exits_2_with_the_fix(
    make: str, fragment: str, run_cli: Callable, tmp_path: Path
) -> None:
    (tmp_path / "taken").write_text("not a folder")
    where = {"a file": tmp_path / "taken", "a folder under a file": tmp_path / "taken" / "run"}.get(make, make)
    code, err = run_cli("+experiment=digits", "logger=none", f"hydra.run.dir={where}")
    assert code == 2, err
    assert fragment in err and "e.g. hydra.run.dir=outputs/my-run" in err and "Traceback" not in err, err


def test_zero_threads_exits_2_before_the_run_starts(run_cli: Callable, tmp_path: Path) -> None:
    code, err = run_cli("+experiment=digits", "logger=none", "threads=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2, err
    assert "threads must be a whole number >= 1" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # (nor the folder: runner.rundir.refused)


# A bad value caught while the run is built; a ??? left in the config; `threads`, refused before the folder is claimed
REFUSALS = {"lr": ["optimizer.lr=-1"], "missing": ["optimizer.lr=???"], "threads": ["threads=0"]}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_run_refused_by_a_config_error_leaves_no_folder(
    refusal: str, run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "earlier").mkdir(parents=True)  # an earlier run's: kept
    # the default folder (outputs/DATE/TIME, made by runner_fresh with its DATE parent), and a new named one
    for where in ([], [f"hydra.run.dir={tmp_path / 'new' / 'run'}"]):
        code, err = run_cli(*DIGITS, *REFUSALS[refusal], *where)
        assert code == 2, err
        assert "error: " in err and "Traceback" not in err, err
        assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["outputs", "outputs/earlier"]


def test_a_resume_refused_by_a_config_error_keeps_its_folder(run_cli: Callable, tmp_path: Path) -> None:
    # a run killed as it started: only files a refused launch writes too, so only its being there before keeps it
    run = tmp_path / "run"
    earlier = {".hydra/config.yaml": "seed: 0\n", "runner.log": "started\n", "logs/rank-0.log": "warning\n"}
    for name, text in earlier.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    code, err = run_cli(*DIGITS, "resume=auto", "optimizer.lr=-1", f"hydra.run.dir={run}")
    assert code == 2 and "optimizer.lr" in err, err
    for name, text in earlier.items():
        assert (run / name).read_text().startswith(text), name  # runner.log: the refusal appended
    assert "optimizer.lr" in (run / "runner.log").read_text()


def test_a_stream_says_once_where_a_file_stops_being_utf8(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # text_stream checks each file's first 8 KB before training; a bad byte past them is said when it is read
    from experiments.lm.stream import TextStreamShards

    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("é" * 10_000)  # two-byte characters: windows cut them anywhere, which is not an error
    bad.write_bytes(b"a" * 9000 + b"\xff" + b"b" * 999)
    stream = TextStreamShards([good, bad], seq_len=64, shuffle=False, block=16)
    windows = iter(stream)
    for _ in range(2 * (20_000 + 10_000) // (16 * 64) * 16):  # two passes over both files
        next(windows)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and f"{bad} is not UTF-8 text at byte 9000" in warnings[0], warnings


# ---- what the CLI says: exit 2 before the run starts (nothing made), exit 3 with advice that fits the run ----------
def test_an_unset_environment_variable_exits_2_naming_it(
    run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built: Callable
) -> None:
    monkeypatch.delenv("RUNNER_UNSET_FOR_TESTS", raising=False)
    code, err = run_cli(*DIGITS, "optimizer.lr=${oc.env:RUNNER_UNSET_FOR_TESTS}", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: optimizer.lr=${oc.env:RUNNER_UNSET_FOR_TESTS}: the "), err
    assert not (tmp_path / "run").exists()
    # oc.env gives text (lr='0.004' is refused): a number's default is decoded, as the message says
    assert "optimizer.lr='${oc.decode:${oc.env:RUNNER_UNSET_FOR_TESTS,default}}' (quoted" in err, err
    _, run = built(*DIGITS, "optimizer.lr='${oc.decode:${oc.env:RUNNER_UNSET_FOR_TESTS,0.004}}'")
    assert run.optimizer.param_groups[0]["lr"] == 0.004


def test_too_many_threads_exit_2_naming_the_cores(run_cli: Callable, tmp_path: Path) -> None:
    code, err = run_cli(*DIGITS, "threads=100000", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2, err
    # one line: said before Hydra adds its own "Error executing job with overrides"
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: threads=100000 is more than this machine's {os.cpu_count()} logical CPU cores")
    assert "or fewer, or threads=null" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("clip", "advice"),
    [
        ([], "Lower the learning rate, enable trainer.gradient_clip_val (e.g. 1.0), or check the data for NaN/inf."),
        (["trainer.gradient_clip_val=0.5"], "clipped already (trainer.gradient_clip_val=0.5): lower the learning rate"),
    ],
)
def test_a_diverged_run_exits_3_with_advice_that_fits_its_clip(
    run_cli: Callable, tmp_path: Path, clip: list[str], advice: str
) -> None:
    diverging = ["optimizer.lr=1e30", "trainer.max_nonfinite_steps=2", "trainer.max_duration=20st"]
    quick = ["callbacks=none", "checkpoint=none", "trainer.log_interval=1st", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(*DIGITS, *diverging, *quick, *clip)
    assert code == 3, err
    assert "stopped after 2 optimizer steps in a row with a non-finite loss" in err and advice in err, err
    assert clip == [] or "enable trainer.gradient_clip_val" not in err  # (it is set: the advice said to set it)


def test_an_end_to_end_loss_on_an_activation_file_exits_2_in_one_paragraph(run_cli: Callable, tmp_path: Path) -> None:
    # a file of activations has no model to splice a coder into, so nothing to take a KL through
    np.save(tmp_path / "acts.npy", np.random.default_rng(0).normal(size=(512, 16)).astype(np.float32))
    args = ["+experiment=sae", "data=activations_file", f"data.train_path={tmp_path / 'acts.npy'}", "model=spliced"]
    code, err = run_cli(*args, "logger=none", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "activations from a file" in err and "data=activations_spliced" in err, err
    assert not (tmp_path / "run").exists()
