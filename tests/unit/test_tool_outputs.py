"""A run folder is data: the tools that read one (runner.tools.features, runner.tools.export, runner.tools.evaluate)
write only where the user said. A forged run folder's symlinks never carry their output elsewhere (each attack has a
victim outside the run folder that must survive unchanged); a killed export or a full disk leaves nothing in the way
of the next run; an output that names a file is one line and exit 2. The serving of the pages: test_serve.py."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
from helpers import ROOT, finished_run, python, refused

from experiments.sae.pages.write import STATIC
from runner import ConfigError, rundir
from runner.rundir.outputs import within
from runner.tools import export, features
from runner.tools.evaluate import evaluate_run

SAE = ["+experiment=sae", "model.n_latents=32", "data.splits.n_train=512", "data.splits.n_val=64"]
SAE += ["data.splits.d=16", "data.splits.n_features=16", "trainer.max_duration=2st", "logger=none", "checkpoint=none"]


@pytest.fixture(scope="module")
def sae_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny SAE on the synthetic preset: model.safetensors and .hydra/config.yaml."""
    directory = tmp_path_factory.mktemp("sae")
    finished_run(directory, *SAE)
    return directory


@pytest.fixture
def forged(sae_run: Path, tmp_path: Path) -> Path:
    """A copy of the run, for a test to plant links in."""
    return Path(shutil.copytree(sae_run, tmp_path / "run"))


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside the run folder, with a file, that no tool may touch."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "index.html").write_text("the victim's own\n")
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- symlinks in the run folder -----------------------------------------------------------------------------------
def test_a_features_link_out_of_the_run_folder_is_refused(forged: Path, victim: Path, capsys) -> None:
    before = _snapshot(victim)
    (forged / "features").symlink_to(victim)
    refused(features.main, [str(forged), "tokens=64"], capsys, "outside the run folder .*Give out=DIR")
    assert _snapshot(victim) == before and sorted(os.listdir(victim)) == ["index.html"]


def test_links_inside_the_pages_folder_are_replaced_never_followed(forged: Path, victim: Path, capsys) -> None:
    before = _snapshot(victim)
    pages = forged / "features"
    pages.mkdir()
    (pages / "index.html").symlink_to(victim / "index.html")
    (pages / "app.js").symlink_to(victim / "app.js")  # dangling: following it would create the file
    (pages / "data").symlink_to(victim)
    (pages / f".index.html.{os.getpid()}.tmp").symlink_to(victim / "index.html")  # write_atomic's temporary name
    (pages / ".app.js.999999999.tmp").write_text("left by a killed run")
    assert features.main([str(forged), "tokens=64"]) == 0
    assert _snapshot(victim) == before and sorted(os.listdir(victim)) == ["index.html"]
    assert not any(p.is_symlink() for p in pages.rglob("*")) and not list(pages.glob(".*.tmp"))
    assert (pages / "index.html").read_bytes() == (STATIC / "index.html").read_bytes()
    assert (pages / "data" / "index.js").is_file() and (pages / "data" / "latents-0000.js").is_file()
    capsys.readouterr()


def test_a_typed_out_inside_the_run_folder_follows_the_same_rule(forged: Path, victim: Path, capsys) -> None:
    (forged / "pages").symlink_to(victim)
    refused(features.main, [str(forged), f"out={forged / 'pages'}"], capsys, "outside the run folder")
    assert sorted(os.listdir(victim)) == ["index.html"]


def test_an_export_link_out_of_the_run_folder_is_refused(forged: Path, victim: Path, capsys) -> None:
    before = _snapshot(victim)
    (forged / "export-saelens").symlink_to(victim / "new")  # dangling: following it would make the folder
    refused(export.main, [str(forged), "--format", "saelens"], capsys, "outside the run folder .*Give --out DIR")
    assert _snapshot(victim) == before and sorted(os.listdir(victim)) == ["index.html"]


def test_an_export_replaces_planted_staging_links_and_writes_its_own_folder(forged: Path, victim: Path) -> None:
    before = _snapshot(victim)
    (forged / f".export-sparsify.partial-{os.getpid()}").symlink_to(victim)  # this process's staging name
    (forged / ".export-sparsify.partial-999999999").symlink_to(victim)  # a dead one's
    assert export.main([str(forged), "--format", "sparsify"]) == 0
    assert _snapshot(victim) == before and sorted(os.listdir(victim)) == ["index.html"]
    assert sorted(os.listdir(forged / "export-sparsify")) == ["cfg.json", "sae.safetensors"]
    assert not list(forged.glob(".export-*"))


def test_the_evaluation_file_replaces_a_link_at_its_name(forged: Path, victim: Path) -> None:
    before = _snapshot(victim)
    (forged / "eval-val.json").symlink_to(victim / "index.html")
    (forged / f".eval-val.json.{os.getpid()}.tmp").symlink_to(victim / "index.html")
    evaluate_run(forged, "val")
    assert _snapshot(victim) == before
    assert not (forged / "eval-val.json").is_symlink() and rundir.read_json(forged / "eval-val.json")["split"] == "val"


def test_a_family_s_sae_names_cannot_lead_out_of_the_output_folder(tmp_path: Path) -> None:
    assert within(tmp_path, "") == tmp_path and within(tmp_path, "blocks_1_k4") == tmp_path / "blocks_1_k4"
    for name in ("..", "/etc", "a/../../b"):
        with pytest.raises(ConfigError, match="not a plain folder name"):
            within(tmp_path, name)


# ---- outputs that name a file, and ports ----------------------------------------------------------------------------
def test_an_output_that_names_a_file_is_one_line_and_exit_2(sae_run: Path, tmp_path: Path, capsys) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    refused(features.main, [str(sae_run), f"out={file}"], capsys, "notes.txt is a file, not a folder: .*out=DIR")
    refused(export.main, [str(sae_run), "--format", "saelens", "--out", str(file)], capsys, "is a file, not a folder")
    assert file.read_text() == "mine\n"
    refused(features.main, [str(sae_run), "port=99999"], capsys, "port=99999: give a port from 1 to 65535")
    refused(export.main, [str(sae_run), "--format", "../x"], capsys, "give saelens, sparsify, hf or circuit_tracer")


# ---- a killed export, a full disk ---------------------------------------------------------------------------------
KILLED = """
import os, signal, sys
import experiments.sae.formats.common as sae_export
from runner.tools.export import main
def dies(path, data, fsync=False):  # the weights half-written, then SIGKILL
    path.write_bytes(bytes(data)[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
sae_export.write_atomic = dies
main(sys.argv[1:])
"""


def test_a_killed_export_leaves_nothing_in_the_way_of_the_next(sae_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = python("-c", KILLED, str(sae_run), "--format", "saelens", "--out", str(out), cwd=ROOT)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not out.exists() and len(list(tmp_path.glob(".out.partial-*"))) == 1  # beside it, not in it
    assert export.main([str(sae_run), "--format", "saelens", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["cfg.json", "sae_weights.safetensors"] and not list(tmp_path.glob(".out.*"))


def test_an_export_folder_an_earlier_version_left_half_written_is_taken(sae_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".sae_weights.safetensors.999999999.tmp").write_bytes(b"half")  # write_atomic's, its process killed
    assert export.main([str(sae_run), "--format", "saelens", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["cfg.json", "sae_weights.safetensors"]


def _full_after(writes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # every write through runner.rundir after the first `writes` fails as on a full disk
    done = []

    def opener(path, mode="r", *args, **kwargs):
        if "w" in mode and len(done) >= writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        done.append(path)
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(rundir.files, "open", opener, raising=False)


def test_a_full_disk_during_an_export_says_so_and_leaves_nothing(sae_run: Path, tmp_path: Path, capsys, monkeypatch):
    out = tmp_path / "out"
    _full_after(1, monkeypatch)  # the weights written, cfg.json not
    args = [str(sae_run), "--format", "saelens", "--out", str(out)]
    err = refused(export.main, args, capsys, "disk full: writing the export to .* run the same command again")
    assert f"nothing was written to {out}" in err
    assert list(tmp_path.iterdir()) == []  # no folder, no staging folder beside it
    monkeypatch.undo()
    assert export.main(args) == 0


def test_a_full_disk_during_the_pages_says_so_and_a_rerun_writes_them(
    sae_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    out = tmp_path / "pages"
    _full_after(2, monkeypatch)
    args = [str(sae_run), "tokens=64", f"out={out}"]
    refused(features.main, args, capsys, "disk full: making the feature pages in .*run the same command again")
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    # the pass cut short stops its progress heartbeat: in a notebook it would print "running for ..." for ever
    beating = [t for t in threading.enumerate() if t.name == "console-heartbeat"]
    for thread in beating:
        thread.join(timeout=5)
    assert not [t for t in beating if t.is_alive()]
    monkeypatch.undo()
    assert features.main(args) == 0
    assert (out / "data" / "index.js").is_file()
    assert (out / "index.html").read_bytes() == (STATIC / "index.html").read_bytes()


# ---- the run folder through a link, and what is planted where report and evaluate write -----------------------------
def test_the_run_folder_spelled_through_a_link_is_still_the_run_folder(
    forged: Path, victim: Path, tmp_path: Path, capsys
) -> None:
    # RUN given through a link, out= through the real path into a link the run folder planted: still its link
    before = _snapshot(victim)
    (forged / "sub").symlink_to(victim)
    (tmp_path / "alias").symlink_to(forged)
    refused(features.main, [str(tmp_path / "alias"), f"out={forged / 'sub'}", "tokens=64"], capsys, "outside the run")
    assert _snapshot(victim) == before


def test_report_writes_its_plots_only_inside_the_folder(forged: Path, victim: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from runner.tools import report

    before = _snapshot(victim)
    (forged / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 0.5}\n')
    (forged / "plots").symlink_to(victim)  # a link at the folder's name: replaced by a real folder
    assert report.main([str(forged)]) == 0
    assert _snapshot(victim) == before and not (forged / "plots").is_symlink()
    (forged / "plots" / "curves.png").unlink()
    (forged / "plots" / "curves.png").symlink_to(victim / "index.html")  # a link at the file's name: replaced
    assert report.main([str(forged)]) == 0
    assert _snapshot(victim) == before and (forged / "plots" / "curves.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()


def test_a_folder_planted_at_the_evaluation_file_is_one_line(forged: Path, capsys) -> None:
    from runner.tools import evaluate

    (forged / "eval-val.json").mkdir()
    refused(
        evaluate.main, [str(forged)], capsys, "writing .*eval-val.json failed: .*Is a directory.*nothing was written"
    )
