"""An installed runner (a wheel, not the editable checkout) finds its configs and trains, from any directory."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import CONF_DIRS, ROOT, child_env, summary

SOURCES = ("pyproject.toml", "README.md", "runner", "experiments", "hydra_plugins")


def test_a_wheel_installed_into_a_fresh_venv_runs_from_another_directory(tmp_path: Path) -> None:
    # Build from a copy: the checkout stays clean (no build/ folder) and only what the wheel ships is installed.
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        str(source),
        "-w",
        str(wheels),
    ]
    subprocess.run(build, check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = wheels.glob("*.whl")
    # every config group's options (runner/conf and the task packages' conf folders, each a package Hydra reads as
    # pkg://) and the feature pages' static files ship in it (the runs below read them)
    shipped = set(zipfile.ZipFile(wheel).namelist())
    files = [path for conf in CONF_DIRS for path in [*conf.rglob("*.yaml"), conf / "__init__.py"]]
    confs = [path.relative_to(ROOT).as_posix() for path in files]
    static = [p.relative_to(ROOT).as_posix() for p in (ROOT / "experiments" / "sae" / "pages" / "static").iterdir()]
    assert not [name for name in confs + static if name not in shipped]

    # The venv sees the dependencies of this one (torch, hydra...: this interpreter's site-packages, listed in a .pth
    # file, whose own .pth files, the editable runner's among them, are not run) but gets runner from the wheel alone.
    # This pip installs into it (--python): the venv needs no pip of its own (ensurepip: 2.5 s of the test).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (own_site,) = venv.glob("lib/python*/site-packages")
    (own_site / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps"]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import runner; print(runner.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout

    run_dir = elsewhere / "run"
    trained = subprocess.run(
        [venv / "bin" / "runner", "+experiment=digits", "trainer.max_duration=5st", f"hydra.run.dir={run_dir}"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
    assert summary(run_dir)["progress"]["step"] == 5
    # the task packages' options are on the installed runner's search path (hydra_plugins/runner_launchers/)
    composed = subprocess.run(
        [venv / "bin" / "runner", "+experiment=sae_lm", "model=sae_multi", "--cfg", "job"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert composed.returncode == 0, composed.stderr
    assert "experiments.sae.coders.multi.MultiSAE" in composed.stdout and "TopKSAE" in composed.stdout
