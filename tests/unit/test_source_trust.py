"""A run folder used as `source.checkpoint` is data, not code: its config's `_target_`s outside trusted_targets are
refused before anything is instantiated."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import CONF_DIRS, finished_run
from omegaconf import DictConfig, OmegaConf

from runner import ConfigError
from runner.build import build
from runner.ckpt.weights import save_weights
from runner.load import load_trained

MARKER = Path("/tmp/runner-source-pwned")


class _Exploit:
    def __reduce__(self):
        return (Path.touch, (MARKER,))


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished digits run folder (3 steps): model.safetensors and .hydra/config.yaml."""
    directory = tmp_path_factory.mktemp("source")
    torch.set_num_threads(1)
    finished_run(directory, "logger=none", "+experiment=digits", "trainer.max_duration=3st")
    yield directory


def _tampered(source: Path, tmp_path: Path, key: str, node: dict) -> Path:
    folder = tmp_path / "evil run"
    shutil.copytree(source, folder)
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    cfg[key] = node
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    torch.save(_Exploit(), tmp_path / "evil.pt")  # what torch.load(weights_only=False) would run
    return folder


WRITES = str(MARKER)
ATTACKS = {
    "torch.load of a pickle": ("model", {"_target_": "torch.load", "f": "EVIL", "weights_only": False}),
    "builtins.open": ("model", {"_target_": "builtins.open", "file": WRITES, "mode": "w"}),
    "Path.write_text": ("model", {"_target_": "pathlib.Path.write_text", "self": WRITES, "data": "x"}),
    "numpy.save": ("model", {"_target_": "numpy.save", "file": WRITES, "arr": [1]}),
    "runner's own file writer": ("model", {"_target_": "runner.rundir.write_atomic", "path": WRITES, "data": "x"}),
    "a look-alike package": ("model", {"_target_": "experimentsx.evil", "x": 1}),
    "an interpolated target": ("model", {"_target_": "${oc.env:EVIL_TARGET,torch.load}", "f": "EVIL"}),
    "nested in the data": ("data", {"_target_": "runner.data.DataModule", "splits": {"_target_": "torch.load"}}),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_source_run_whose_config_names_untrusted_code_is_refused_before_running_it(
    attack: str, source_run: Path, tmp_path: Path
) -> None:
    key, node = ATTACKS[attack]
    node = {k: (str(tmp_path / "evil.pt") if v == "EVIL" else v) for k, v in node.items()}
    folder = _tampered(source_run, tmp_path, key, node)
    MARKER.unlink(missing_ok=True)
    with pytest.raises(ConfigError) as caught:
        load_trained(folder)
    message = str(caught.value)
    assert "refusing to build" in message and "trusted_targets=[experiments,runner.data,mypackage]" in message
    assert f"{key}._target_=" in message or f"{key}.splits._target_=torch.load" in message
    assert not MARKER.exists()


def test_trusted_targets_lets_a_users_own_package_in_for_the_classes_that_opt_in(
    source_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a trusted package's class that did not opt in (torch.nn.Linear) is refused: trust names where to look, the mark
    # says what may be built
    folder = _tampered(
        source_run, tmp_path, "model", {"_target_": "torch.nn.Linear", "in_features": 64, "out_features": 10}
    )
    with pytest.raises(ConfigError, match=r"model._target_=torch.nn.Linear does not opt in"):
        load_trained(folder, trusted=["experiments", "runner.data", "torch.nn"])
    package = tmp_path / "pkg" / "users_linear_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from torch import nn\n\nfrom runner.config.trust import buildable\n\n\n"
        "@buildable('model')\nclass Linear(nn.Linear):\n    pass\n\n\nclass Unmarked(Linear):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setitem(sys.modules, "users_linear_pkg", None)  # undone at the end: no module left imported
    del sys.modules["users_linear_pkg"]
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    cfg.model._target_ = "users_linear_pkg.Linear"
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    (folder / "model.safetensors").unlink()
    save_weights(torch.nn.Linear(64, 10), folder / "model.safetensors")
    model, cfg = load_trained(folder, trusted=["experiments", "runner.data", "users_linear_pkg"])
    assert isinstance(model, torch.nn.Linear) and not model.training
    assert cfg.data._target_ == "runner.data.DataModule"
    # the mark is not inherited: a subclass may do what its base does not
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    cfg.model._target_ = "users_linear_pkg.Unmarked"
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    with pytest.raises(ConfigError, match=r"model._target_=users_linear_pkg.Unmarked does not opt in"):
        load_trained(folder, trusted=["experiments", "runner.data", "users_linear_pkg"])


def test_the_launch_folder_s_runner_yaml_trusts_a_package_and_a_run_folder_s_never_does(
    source_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from runner.load import TRUSTED_TARGETS, trusted_here
    from runner.tools import evaluate

    project = tmp_path / "project"  # what runner init makes: the user's package and runner.yaml beside it
    (project / "trusted_project_pkg").mkdir(parents=True)
    (project / "trusted_project_pkg" / "__init__.py").write_text(
        "from experiments.digits import MLPClassifier\nfrom runner.config.trust import buildable\n\n\n"
        "@buildable('model')\nclass Model(MLPClassifier):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.setitem(sys.modules, "trusted_project_pkg", None)  # undone at the end: no module left imported
    del sys.modules["trusted_project_pkg"]
    cfg = OmegaConf.load(source_run / ".hydra" / "config.yaml")
    folder = _tampered(source_run, tmp_path, "model", {**cfg.model, "_target_": "trusted_project_pkg.Model"})
    # a run folder that says it trusts trusted_project_pkg is not believed, wherever it is launched from
    (folder / "runner.yaml").write_text("trusted_targets: [trusted_project_pkg]\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert trusted_here() == TRUSTED_TARGETS
    assert evaluate.main([str(folder)]) == 2
    assert "model._target_=trusted_project_pkg.Model" in capsys.readouterr().err
    # the project the user launches from is
    (project / "runner.yaml").write_text("trusted_targets: [trusted_project_pkg]\n")
    monkeypatch.chdir(project)
    assert trusted_here() == (*TRUSTED_TARGETS, "trusted_project_pkg")
    assert evaluate.main([str(folder), "split=val"]) == 0
    assert "val/acc" in capsys.readouterr().out
    # and a project file that is not a list of packages is refused, naming the file
    (project / "runner.yaml").write_text("trusted_targets: trusted_project_pkg\n")
    assert evaluate.main([str(folder)]) == 2
    assert "runner.yaml: trusted_targets must be a list" in capsys.readouterr().err


def test_the_sae_digits_preset_passes_trusted_targets_to_both_readers(
    compose_cfg: Callable[..., DictConfig], source_run: Path, tmp_path: Path
) -> None:
    folder = _tampered(source_run, tmp_path, "model", {"_target_": "torch.load", "f": str(tmp_path / "evil.pt")})
    MARKER.unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="refusing to build the model"):
        build(compose_cfg("+experiment=sae_digits", f"source.checkpoint={folder}"))
    assert not MARKER.exists()
    cfg = compose_cfg("+experiment=sae_digits", f"source.checkpoint={source_run}", "trusted_targets=[experiments]")
    with pytest.raises(ConfigError, match=r"data._target_=runner.data.DataModule"):
        build(cfg)  # the user's allow-list is the one applied (it lacks runner.data)
    assert list(cfg.callbacks.sae_splice.trusted_targets) == ["experiments"]


# --- trust is decided on what a target is, not how it is spelled ----------------------------------------------------
# Hydra resolves `_target_` attribute by attribute, so `runner.data.torch.load` *is* torch.load. Every spelling below
# runs code through runner.tools.evaluate or source.checkpoint wherever trust reads only how a target is spelled.
EVIL_LOAD = {"_target_": "runner.data.torch.load", "f": "PAYLOAD", "weights_only": False}
SPELLED = {
    "a module attribute that is torch": ("model", EVIL_LOAD),
    "torch's os": ("model", {"_target_": "runner.data.torch.os.system", "command": f"touch {MARKER}"}),
    "a class of another package": ("model", {"_target_": "experiments.digits.Path.touch", "self": str(MARKER)}),
    "an import alias": ("model", {"_target_": "experiments.digits.importlib.import_module", "name": "antigravity"}),
    "a dunder path": ("model", {"_target_": "experiments.digits.MLPClassifier.__init__.__globals__"}),
    "data.splits": ("data", {"_target_": "runner.data.DataModule", "splits": EVIL_LOAD}),
    "nested in the model": ("model", {"_target_": "experiments.digits.MLPClassifier", "hidden": EVIL_LOAD}),
    "in a list": ("data", {"_target_": "runner.data.DataModule", "splits": [1, {"x": EVIL_LOAD}]}),
    "in _args_": ("model", {"_target_": "experiments.digits.MLPClassifier", "_args_": [EVIL_LOAD]}),
    "partial": ("model", {**EVIL_LOAD, "_partial_": True}),
    "functools.partial": ("model", {"_target_": "functools.partial", "_args_": ["${oc.env:EVIL_TARGET}", "PAYLOAD"]}),
    "interpolated from the environment": ("model", {"_target_": "${oc.env:EVIL_TARGET}", "f": "PAYLOAD"}),
    "interpolated from another key": ("model", {"_target_": "${data.evil}", "f": "PAYLOAD", "weights_only": False}),
    "not a string": ("model", {"_target_": ["runner.data.torch.load"], "f": "PAYLOAD"}),
    "runner's precision": ("precision", {**EVIL_LOAD, "_target_": "runner.precision.torch.load"}),
    "a callback": ("callbacks", {"ema": {**EVIL_LOAD, "_target_": "runner.callbacks.ema.torch.load"}}),
    "a callback's argument": (
        "callbacks",
        {"truth": {"_target_": "experiments.sae.callbacks.GroundTruthRecovery", "thresholds": EVIL_LOAD}},
    ),
}


REASONS = (
    "reaches the module `torch` through",
    "goes through `experiments.digits.Path`, which is not a module",
    "reaches the module `importlib` through `experiments.digits.importlib`",
    "is not a dotted path of public names",
    "is not under the trusted module paths",  # functools.partial
    "is a list, not a dotted path",
    "takes plain data",  # a component given where the parameter takes data
)


def _evil(source: Path, tmp_path: Path, key: str, node: dict) -> Path:
    def placed(value: object) -> object:  # the payload's path where a spelling reads "PAYLOAD"
        if isinstance(value, dict):
            return {k: placed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [placed(v) for v in value]
        return str(tmp_path / "evil.pt") if value == "PAYLOAD" else value

    folder = _tampered(source, tmp_path, key, placed(node))
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    cfg.data.evil = "runner.data.torch.load"  # read by the `${data.evil}` spelling
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    return folder


def test_the_dangerous_spelling_is_real() -> None:
    # the control: what Hydra would call for these strings, had the check let them through
    from hydra._internal.utils import _locate

    assert _locate("runner.data.torch.load") is torch.load
    assert _locate("runner.callbacks.ema.torch.load") is torch.load


@pytest.mark.parametrize("attack", list(SPELLED))
def test_runner_evaluate_refuses_every_spelling_with_exit_2_and_runs_nothing(
    attack: str, source_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from runner.tools.evaluate import main

    monkeypatch.setenv("EVIL_TARGET", "runner.data.torch.load")
    key, node = SPELLED[attack]
    folder = _evil(source_run, tmp_path, key, node)
    MARKER.unlink(missing_ok=True)
    assert main([str(folder)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: refusing to build the") and error.count("\n") == 1, error
    assert any(reason in error for reason in REASONS), error
    assert not MARKER.exists() and not (folder / "eval-val.json").exists()


def test_source_checkpoint_refuses_a_forged_spelling(
    compose_cfg: Callable[..., DictConfig], source_run: Path, tmp_path: Path
) -> None:
    folder = _evil(source_run, tmp_path, *SPELLED["a module attribute that is torch"])
    MARKER.unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"model._target_=runner.data.torch.load reaches the module `torch`"):
        build(compose_cfg("+experiment=sae_digits", f"source.checkpoint={folder}"))
    assert not MARKER.exists()


def test_a_resolver_that_writes_is_refused_before_it_runs(source_run: Path, tmp_path: Path) -> None:
    made = tmp_path / "made by the config"
    folder = _tampered(
        source_run,
        tmp_path,
        "model",
        {"_target_": "experiments.digits.MLPClassifier", "hidden": f"${{runner_fresh:{made}}}"},
    )
    with pytest.raises(ConfigError, match=r"calls resolvers that do more than read: runner_fresh \(at model.hidden\)"):
        load_trained(folder)
    assert not made.exists()


def test_a_truncated_target_says_the_config_may_be_truncated(source_run: Path, tmp_path: Path) -> None:
    folder = _tampered(source_run, tmp_path, "model", {"_target_": "experi"})
    with pytest.raises(ConfigError, match=r"model._target_=experi is no importable name \(a truncated"):
        load_trained(folder)


def test_an_untrusted_callback_is_left_out_and_said_but_the_run_evaluates(
    source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from runner.tools.evaluate import main

    folder = _tampered(source_run, tmp_path, "callbacks", {"mine": {"_target_": "torch.nn.Identity"}})
    assert main([str(folder)]) == 0
    assert "callbacks.mine not run: callbacks.mine._target_=torch.nn.Identity is not under the trusted" in (
        capsys.readouterr().err
    )


def test_every_shipped_target_is_trusted_under_its_own_package() -> None:
    # no false refusal: each `_target_` of the shipped configs (runner/conf and the task packages' conf folders) is a
    # class or function reached through its own modules
    from runner.config import trust

    targets = {
        line.split("_target_:")[1].split("#")[0].strip()
        for conf in CONF_DIRS
        for path in conf.rglob("*.yaml")
        for line in path.read_text().splitlines()
        if "_target_:" in line and not line.lstrip().startswith("#")
    }
    targets = {t for t in targets if t and "," not in t}
    assert len(targets) > 40
    slurm = importlib.util.find_spec("submitit") is not None  # the SLURM launcher's module imports it (runner[slurm])
    for target in targets - (set() if slurm else {t for t in targets if ".slurm_launcher." in t}):
        package = target.split(".")[0] if not target.startswith("runner.") else ".".join(target.split(".")[:2])
        assert trust.target_problem(target, [package]) is None, target
    assert trust.target_problem("torch.nn.Linear", ["torch.nn"]) is None  # a user's own trusted package
    assert trust.target_problem("torch.nn.Linear", ["torch.nn.modules.conv"])[1] is False  # merely untrusted


def test_a_run_folder_cannot_widen_the_trust_of_the_runs_it_names(
    source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # B's data is an SAE source reading run A with `trusted_targets: [torch, ...]` of B's own choosing; A's model is
    # torch.load of a pickle. Reading B must apply the reader's trust to A too, not B's.
    (tmp_path / "a").mkdir()
    inner = _tampered(
        source_run,
        tmp_path / "a",
        "model",
        {"_target_": "torch.load", "f": str(tmp_path / "a" / "evil.pt"), "weights_only": False},
    )
    hooked = {
        "_target_": "experiments.sae.sources.hooked.HookedData",
        "checkpoint": str(inner),
        "module": "net.1",
        "trusted_targets": ["torch", "experiments", "runner.data"],
        "batch_size": 8,
    }
    outer = _tampered(source_run, tmp_path, "data", hooked)
    MARKER.unlink(missing_ok=True)
    from runner.tools.evaluate import main

    assert main([str(outer)]) == 2
    assert "refusing to build the model of" in capsys.readouterr().err
    assert not MARKER.exists()


# --- least authority: a run folder builds only what opted in to its slot, with plain data for arguments -------------
# Each attack below writes, deletes or makes files through runner's own functions wherever any public function of a
# trusted package is accepted, with any arguments. Each has a victim that must come out unchanged.
def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("index.html", "manifest.json", "shard-00000.npy"):
        (victim / name).write_text(f"the user's {name}")
    return victim


def _untouched(victim: Path) -> bool:
    files = sorted(p.name for p in victim.iterdir())
    return files == ["index.html", "manifest.json", "shard-00000.npy"] and all(
        (victim / name).read_text() == f"the user's {name}" for name in files
    )


LEAST = {
    "a page writer through a path factory in _args_": (
        "model",
        {
            "_target_": "experiments.sae.pages.write.family_index",
            "_args_": [{"_target_": "experiments.lm.data.cache_root", "_args_": ["VICTIM", "x"]}, ["pwned"]],
        },
        "experiments.sae.pages.write.family_index does not opt in",
    ),
    "the activation cache's writer": (
        "data",
        {
            "_target_": "experiments.sae.sources.cache.write",
            "directory": "VICTIM",
            "key": {},
            "source": None,
            "rows": 1,
        },
        "experiments.sae.sources.cache.write does not opt in",
    ),
    "write_once with a partial fill": (
        "data",
        {
            "_target_": "experiments.lm.data.write_once",
            "folder": "NEW",
            "fill": {"_target_": "experiments.sae.pages.write.family_index", "_partial_": True, "names": []},
            "option": "x",
        },
        "experiments.lm.data.write_once does not opt in",
    ),
    "a writer as the data's splits": (
        "data",
        {
            "_target_": "runner.data.DataModule",
            "batch_size": 8,
            "splits": {"_target_": "experiments.sae.pages.write.family_index", "out": "VICTIM", "names": []},
        },
        "data.splits._target_=experiments.sae.pages.write.family_index does not opt in",
    ),
    "a data class in the model's slot": (
        "model",
        {"_target_": "experiments.sae.sources.hooked.LiveActivations", "checkpoint": "VICTIM", "module": "net.1"},
        "LiveActivations opts in as data; here it stands for an nn.Module class",
    ),
    "a component where plain data goes": (
        "model",
        {"_target_": "experiments.digits.MLPClassifier", "hidden": {"_target_": "experiments.digits.MLPClassifier"}},
        "model.hidden holds a _target_, but `hidden` of experiments.digits.MLPClassifier takes plain data",
    ),
    "a partial model": (
        "model",
        {"_target_": "experiments.digits.MLPClassifier", "_partial_": True},
        "model._partial_ asks for a partial",
    ),
    "positional arguments that fit nothing": (
        "model",
        {"_target_": "experiments.digits.MLPClassifier", "_args_": list(range(9))},
        "model._args_ do not fit MLPClassifier",
    ),
}


def _placed(value: object, tmp_path: Path) -> object:
    if isinstance(value, dict):
        return {k: _placed(v, tmp_path) for k, v in value.items()}
    if isinstance(value, list):
        return [_placed(v, tmp_path) for v in value]
    return {"VICTIM": str(tmp_path / "victim"), "NEW": str(tmp_path / "new")}.get(value, value)  # type: ignore[call-overload]


def _tool(name: str, folder: Path, compose_cfg: Callable[..., DictConfig]) -> int:
    # each way a user reads a run folder, as its command line does: the exit code (2 for a refusal)
    from runner.tools import evaluate, export, features, generate

    if name == "source.checkpoint":
        try:
            build(compose_cfg("+experiment=sae_digits", f"source.checkpoint={folder}"))
        except ConfigError:
            return 2
        return 0
    argv = {"export": [str(folder), "--format", "saelens"], "generate": [str(folder), "prompt=x"]}
    module = {"evaluate": evaluate, "features": features, "export": export, "generate": generate}[name]
    return module.main(argv.get(name, [str(folder)]))


@pytest.mark.parametrize("attack", list(LEAST))
def test_a_run_folder_builds_only_what_opted_in_to_its_slot_and_touches_no_file(
    attack: str, source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from runner.tools.evaluate import main

    key, node, reason = LEAST[attack]
    victim = _victim(tmp_path)
    folder = _tampered(source_run, tmp_path, key, _placed(node, tmp_path))
    assert main([str(folder)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: refusing to build the") and reason in error, error
    assert "@runner.config.trust.buildable" in error
    assert _untouched(victim) and not (tmp_path / "new").exists() and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("tool", ["evaluate", "features", "export", "generate", "source.checkpoint"])
def test_every_reading_tool_refuses_the_page_writer_and_the_victim_survives(
    tool: str, source_run: Path, tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    victim = _victim(tmp_path)
    key, node, _ = LEAST["a page writer through a path factory in _args_"]
    folder = _tampered(source_run, tmp_path, key, _placed(node, tmp_path))
    assert _tool(tool, folder, compose_cfg) == 2
    assert _untouched(victim) and not list(tmp_path.rglob("pwned"))


RESOLVED = {
    "a top-level key interpolated into the model": ({"evil": "${runner_fresh:MADE}"}, "${evil}"),
    "a resolver assembled by oc.decode": ({"a": "runner_fresh"}, "${oc.decode:'\\${${a}:MADE}'}"),
    "a resolver whose name is interpolated": ({"a": "runner_fresh"}, "${${a}:MADE}"),
    "a key that is never built": ({"trainer": {"evil": "${runner_fresh:MADE}"}}, 512),
}


@pytest.mark.parametrize("attack", list(RESOLVED))
def test_every_resolver_of_the_whole_folder_config_is_checked_before_any_resolves(
    attack: str, source_run: Path, tmp_path: Path
) -> None:
    from runner.config.resolvers import register

    register()  # runner_fresh, as in any runner process

    made = tmp_path / "made by the config"
    top, hidden = RESOLVED[attack]
    folder = _tampered(source_run, tmp_path, "model", {"_target_": "experiments.digits.MLPClassifier"})
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    cfg.model.hidden = hidden.replace("MADE", str(made)) if isinstance(hidden, str) else hidden
    cfg = OmegaConf.merge(cfg, OmegaConf.create(_placed(top, tmp_path)))
    text = OmegaConf.to_yaml(cfg).replace("MADE", str(made))
    (folder / ".hydra" / "config.yaml").write_text(text)
    with pytest.raises(
        ConfigError, match=r"calls resolvers that do more than read: .*(runner_fresh|\$\{a\}|oc.decode)"
    ):
        load_trained(folder)
    assert not made.exists()
    if attack != "a key that is never built":  # the control: unchecked, resolving the model makes the folder
        OmegaConf.to_container(OmegaConf.load(folder / ".hydra" / "config.yaml").model, resolve=True)
        assert made.exists()


@pytest.fixture(scope="module")
def sae_run(source_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished sae_digits run (3 steps) on source_run: its data is HookedData, which may write a cache."""
    directory = tmp_path_factory.mktemp("sae")
    finished_run(
        directory,
        "logger=none",
        "+experiment=sae_digits",
        f"source.checkpoint={source_run}",
        "trainer.max_duration=3st",
        "data.buffer_size=512",
        "callbacks=none",
    )
    return directory


@pytest.mark.parametrize("target", ["CachedActivations", "HookedData"])
def test_positional_arguments_do_not_get_around_the_confined_cache(target: str, sae_run: Path, tmp_path: Path) -> None:
    # the cache folder given by position (CachedActivations' 3rd parameter, an older folder's HookedData's 8th):
    # bound to its name, it is confined like data.cache=; and the folder's own trust, by position, is the reader's too.
    # HookedData is read as the option its keyword flags chose: its positions then name another signature's, refused.
    cfg = OmegaConf.to_container(OmegaConf.load(sae_run / ".hydra" / "config.yaml"))
    data = cfg["data"]
    cache, evil = tmp_path / "cache the folder chose", ["torch", "experiments", "runner.data"]
    where = [data.pop("checkpoint"), data.pop("module")]
    buffer, d = [data.pop("buffer_size"), data.pop("samples_per_epoch")], data.pop("d")
    del data["trusted_targets"], data["shard"]
    data["_target_"] = f"experiments.sae.sources.hooked.{target}"
    if target == "CachedActivations":
        data["_args_"] = [*where, str(cache), 1024, "float32", 512, d, evil]
    else:
        data["_args_"] = [*where, *buffer, d, evil, data.pop("skip_positions"), str(cache)]
    folder = tmp_path / "evil sae"
    shutil.copytree(sae_run, folder)
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    if target == "HookedData":
        with pytest.raises(ConfigError, match="refusing to build the data of"):
            load_trained(folder)
        assert not cache.exists()
        return
    model, built = load_trained(folder)
    assert built.data.cache is None and list(built.data.trusted_targets) == ["experiments", "runner.data"]
    assert "_args_" not in built.data and not cache.exists()
    assert type(model).__name__ == "TopKSAE"


def test_a_run_folder_of_2026_11_21_still_names_a_buildable_data_module() -> None:
    # every shipped option and experiment builds in its slot: tests/unit/test_configs.py checks each composed config
    # as load_trained would (check_run); an older run folder names ActivationFiles where synthetic.py still exports it
    from runner.config import trust
    from runner.load import TRUSTED_TARGETS

    old = {"_target_": "experiments.sae.sources.synthetic.ActivationFiles", "train_path": "a.npy", "batch_size": 8}
    assert trust.check(old, "data", TRUSTED_TARGETS, "data", "a run folder of 2026-11-21") == old


def test_buildable_refuses_a_mark_that_does_not_fit() -> None:
    from runner.config.trust import buildable

    with pytest.raises(TypeError, match="not an nn.Module class"):
        buildable("model")(print)
    with pytest.raises(TypeError, match=r"has no parameter\(s\) \['splits'\]"):
        buildable("model", splits="splits")(torch.nn.Identity)
    with pytest.raises(ValueError, match="unknown slot"):
        buildable("writer")


# Ways around the checks above: each, if not refused, runs code, calls out, or hangs.
PAYLOAD = "{_target_:numpy.savetxt,fname:MARK,X:[],header:pwned,comments:''}"
ESCAPED = {  # an escaped \${...} reads as text to the resolver check, then instantiate resolved it again
    "model": ("model", "dropout"),
    "data": ("data", "seed"),
    "precision": ("precision", "flush_denormal"),
    "a metric callback": ("callbacks", "truth"),
}


@pytest.mark.parametrize("slot", list(ESCAPED))
def test_a_value_that_would_be_resolved_again_when_built_is_refused(
    slot: str, source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from runner.tools.evaluate import main

    mark = tmp_path / "written by numpy.savetxt"
    value = "\\${oc.create:" + PAYLOAD.replace("MARK", str(mark)) + "}"
    key, name = ESCAPED[slot]
    folder = tmp_path / "evil run"
    shutil.copytree(source_run, folder)
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    if key == "callbacks":
        cfg.callbacks = {name: {"_target_": "experiments.sae.callbacks.GroundTruthRecovery", "thresholds": value}}
    elif key == "precision":
        cfg.precision = {"_target_": "runner.precision.FP32", name: value}
    else:
        cfg[key][name] = value
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    assert main([str(folder)]) == 2
    assert "holds `${`, which building would resolve again" in capsys.readouterr().err
    assert not mark.exists()


def test_a_hub_model_a_run_folder_names_is_read_from_the_cache_alone(
    sae_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # a request for hf:attacker/... would tell the folder's author it was opened (and fetch their model)
    import socket

    from runner.tools.evaluate import main

    pytest.importorskip("transformers")
    calls: list[object] = []

    def connect(self: socket.socket, address: object) -> None:
        calls.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", connect)
    folder = tmp_path / "beacon"
    shutil.copytree(sae_run, folder)
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    cfg.data.checkpoint = "hf:attacker/beacon-user-opened-my-folder"
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    assert main([str(folder)]) == 2
    error = capsys.readouterr().err
    assert "source.checkpoint=hf-cache:attacker/beacon" in error and "the hub's cache alone" in error, error
    assert calls == []


def test_files_that_never_end_are_refused_before_they_are_read(
    source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import os

    from runner.tools.features import main

    fifo = tmp_path / "fifo run"
    shutil.copytree(source_run, fifo)
    (fifo / ".hydra" / "config.yaml").unlink()
    os.mkfifo(fifo / ".hydra" / "config.yaml")  # opened for reading, it waits for a writer forever
    zero = tmp_path / "zero run"
    shutil.copytree(source_run, zero)
    (zero / "model.safetensors").unlink()
    (zero / "model.safetensors").symlink_to("/dev/zero")
    for folder, what in ((fifo, "config.yaml"), (zero, "model.safetensors")):
        assert main([str(folder)]) == 2
        assert f"{what} does not exist (or is no file)" in capsys.readouterr().err
    bomb = tmp_path / "bomb run"
    shutil.copytree(source_run, bomb)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 12)]
    with open(bomb / ".hydra" / "config.yaml", "a") as f:  # 1 KB that expands to 10 x 5^11 values
        f.write("\n".join(lines) + "\n")
    assert main([str(bomb)]) == 2
    assert "uses YAML aliases" in capsys.readouterr().err


def test_a_callback_left_out_may_hold_any_text(source_run: Path, tmp_path: Path) -> None:
    # never built, so never resolved again: a run's text_samples prompt with a literal ${ does not refuse the folder
    from runner.tools.evaluate import main

    mark = tmp_path / "written by numpy.savetxt"
    folder = tmp_path / "run"
    shutil.copytree(source_run, folder)
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    value = "\\${oc.create:" + PAYLOAD.replace("MARK", str(mark)) + "}"
    cfg.callbacks = {"samples": {"_target_": "experiments.lm.callbacks.TextSamples", "prompts": [value]}}
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    assert main([str(folder), "split=val"]) == 0
    assert not mark.exists()


def test_a_rebuilt_run_s_corpus_is_cached_in_a_folder_of_the_process_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # data.paths may name any readable file: encoded into ~/.cache/runner, a forged folder copied them there
    from runner.tools.evaluate import main

    secret = tmp_path / "secret"
    secret.mkdir()
    for i in range(2):
        (secret / f"{i}.txt").write_text(f"PRIVATE KEY {i} " * 200)
    run = tmp_path / "lm"
    run.mkdir()
    model = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16"]
    finished_run(
        run, "+experiment=lm", *model, "trainer.max_duration=2st", "logger=none", f"data.paths=[{secret}/*.txt]"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user cache"))
    assert main([str(run)]) == 0
    assert "val/loss" in capsys.readouterr().out
    assert not (tmp_path / "user cache").exists()
