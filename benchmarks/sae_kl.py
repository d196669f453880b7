"""End-to-end SAE training, runner against sparsify: runner's `+experiment=sae_lm_kl` (model.loss=kl) and sparsify's
Trainer with `loss_fn="kl"`, both beside reconstruction training (runner's `+experiment=sae_lm`, sparsify's
`loss_fn="fvu"`), on the lm preset's GPT's residual stream after blocks.{--layer}; one held-out scorer for all; and
where runner's kl step spends its time.

    python benchmarks/sae_kl.py --lm RUN_DIR [--steps 400] [--seeds 0 1] [--windows 8] [--layer 2] [--json out.json]
        [--contenders runner-kl sparsify-kl runner-recon sparsify-recon runner-kl-compiled] [--sparsify-python PY]
        [--profile-steps 20]

Without --lm it first trains `python -m runner +experiment=lm` (with --lm-args), as benchmarks/sae_init.py does.

Same for every contender: the TopK SAE's width and k, a step of --windows windows of the GPT (each giving its
seq_len - 1 positions after the first: 1,016 rows a step at the lm preset's 8 x 127), --steps steps, Adam at --lr with
a linear warmup over 1% of the steps and a linear decay to 0, the seed, one thread, a fresh process each, in rotating
order. The kl contenders train on the very same windows in the same order: runner's own loader for the sae_lm_kl run
(data=activations_spliced) writes them to a file first, and sparsify reads that file in order. sparsify trains
runner's GPT rewritten in plain torch (benchmarks/peers/gpt.py; its logits are checked equal to runner's GPT's, in
sparsify's own virtualenv, before anything is scored). runner's reconstruction baseline reads rows of the same
windows' distribution through its ring buffer (+experiment=sae_lm at data.batch_size = windows x kept positions);
sparsify's reads the kl contenders' windows, --windows a step, as its users do. runner-kl-compiled is runner-kl with
compile=blocks (the GPT's blocks after the hook point compiled by torch.compile at the first step; the steady state's
rate leaves that step out).

Scored in this process, the same way for every trained SAE (rewritten into benchmarks/peers/driver.py's shared form),
on the lm run's validation windows: the spliced model's CE and KL from the clean model's next-token distribution
(nats per token, over every position; SourceModel.compare), the loss recovered against zero and mean ablation of the
hooked positions (as SpliceEval), FVE, L0 and the share of latents that never fire on the held-out rows (float64,
driver.score); speed: rows (positions trained on) per second over the steady state (median of ten stretches after
the first 10% of steps), and per second of the process's own CPU time (what a machine shared with other work moves
least). Then --profile-steps steps of runner's Spliced.training_step in this process with timers around its parts:
in each pass (clean, spliced) the GPT's embedding and blocks up to the hook point, its later blocks, norm and head;
the SAE's step; the backward (the SAE's own backward timed apart on the same rows: the rest is the frozen later
blocks'); the optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, machine, spawn, write_json  # noqa: E402
from benchmarks.peers.driver import score  # noqa: E402
from benchmarks.sae_multi import _compose  # noqa: E402

CONTENDERS = ["runner-kl", "sparsify-kl", "runner-recon", "sparsify-recon", "runner-kl-compiled"]
SKIP = 1  # runner's source.skip_positions in the sae_lm presets: the first position's stream is left out
AUXK = 1 / 32  # both tools' AuxK coefficient (runner's default; sparsify's auxk_alpha, used by its fvu mode only)
DEAD_TOKENS = 1_000_000  # runner's sae_lm dead_window (1e6tok); sparsify's dead_feature_threshold set to it


def lm_run(args: argparse.Namespace, out: Path) -> Path:
    """The lm run: --lm, or one trained here once with --lm-args."""
    lm = Path(args.lm).resolve() if args.lm else out / "lm"
    if not (lm / "model.safetensors").exists() or not (lm / ".hydra" / "config.yaml").exists():
        if args.lm:
            raise SystemExit(f"{lm} holds no model.safetensors and .hydra/config.yaml: is it a finished lm run?")
        command = [sys.executable, "-m", "runner", "+experiment=lm", "logger=none", *args.lm_args]
        subprocess.run([*command, f"hydra.run.dir={lm}"], check=True, env={**os.environ, "WANDB_MODE": "offline"})
    return lm


def kl_overrides(lm: Path, args: argparse.Namespace, seed: int) -> list[str]:
    """What runner's sae_lm_kl run is given (the data and the SAE's size): composed here to write its windows."""
    return [
        *("+experiment=sae_lm_kl", f"source.checkpoint={lm}", f"source.layer={args.layer}", f"seed={seed}"),
        *(f"data.batch_size={args.windows}", f"model.coder.n_latents={args.n_latents}", f"model.coder.k={args.k}"),
    ]


def write_data(lm: Path, args: argparse.Namespace, out: Path) -> dict[str, Path]:
    """heldout.npy (the activation rows of the lm run's validation windows, as runner's validation reads them) and,
    per seed, windows-s<seed>.npy: the token windows runner's sae_lm_kl run trains on, in its order, from its own
    data module's loader."""
    from runner.build import build_data

    out.mkdir(parents=True, exist_ok=True)
    files = {"heldout": out / "heldout.npy", **{f"windows{s}": out / f"windows-s{s}.npy" for s in args.seeds}}
    files["probe"] = out / "probe-ids.npy"
    if not files["probe"].exists():
        np.save(files["probe"], lm_probe_ids(lm).numpy())
    for seed in args.seeds:
        if files[f"windows{seed}"].exists() and files["heldout"].exists():
            continue
        data = build_data(_compose(kl_overrides(lm, args, seed)))
        loader = data.train_loader()
        if len(loader) < args.steps:
            raise SystemExit(
                f"the lm's training split holds {len(loader)} steps of {args.windows} windows: "
                f"fewer than --steps {args.steps}"
            )
        batches = [batch["tokens"] for _, batch in zip(range(args.steps), loader, strict=False)]
        np.save(files[f"windows{seed}"], torch.cat(batches).numpy())
        np.save(files["heldout"], data.splits["val"].tensors[0].float().numpy())
    return files


def runner_command(name: str, spec: dict, lm: Path, run_dir: Path) -> list[str]:
    """`python -m runner` for runner-kl (+experiment=sae_lm_kl; runner-kl-compiled with compile=blocks) or
    runner-recon (+experiment=sae_lm), with the job's settings; their validation at the end (callbacks=sae_splice: the
    spliced CE and KL, runner's own figures)."""
    cool, kl = spec["steps"] - spec["lr_warmup_steps"], name.startswith("runner-kl")
    sae = "model.coder" if kl else "model"
    data = spec["batch"] if kl else spec["rows_per_step"]  # windows, or rows
    return [
        *(sys.executable, "-m", "runner", f"+experiment={'sae_lm_kl' if kl else 'sae_lm'}"),
        *(["compile=blocks"] if name == "runner-kl-compiled" else []),
        *(f"source.checkpoint={lm}", f"source.layer={spec['layer']}", f"data.batch_size={data}"),
        *(f"{sae}.n_latents={spec['n_latents']}", f"{sae}.k={spec['k']}", f"{sae}.auxk_coeff={spec['auxk_coeff']}"),
        *(f"{sae}.dead_window={spec['dead_tokens']}tok", f"optimizer.lr={spec['lr']}", "scheduler=wsd"),
        *(f"scheduler.warmup={spec['lr_warmup_steps']}st", f"scheduler.decay={cool}st", "scheduler.min_lr_ratio=0"),
        *(f"trainer.max_duration={spec['steps']}st", "trainer.val_interval=1.0dur", "logger=[jsonl]"),
        *("checkpoint=none", f"seed={spec['seed']}", f"threads={spec['threads']}"),
        *(f"distributed.device={spec['device']}", f"hydra.run.dir={run_dir}"),
        "+callbacks.peer_timer._target_=benchmarks.timer.StepTimer",
        f"+callbacks.peer_timer.warmup={spec['warmup_steps']}",
        f"+callbacks.peer_timer.out={spec['out']}",
    ]


def runner_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """runner's trained SAE in the shared form (a spliced run's is its `coder.`)."""
    from safetensors.torch import load_file

    state = load_file(str(run_dir / "model.safetensors"))
    state = {name.removeprefix("coder."): value for name, value in state.items()}
    keep = {name: state[name] for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
    return {**keep, "center": state["b_dec"], "scale": state["input_scale"]}


def run_one(name: str, spec: dict, args: argparse.Namespace, lm: Path, out: Path) -> dict:
    """One fresh process of contender `name`; its stamps, weights (shared form) and own figures."""
    spec = {**spec, "out": str(out / f"{name}.json")}
    threads = {"OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])}
    log = out / f"{name}.log"
    if name.startswith("runner"):
        run_dir = out / f"{name}-run"
        shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own folder: a fresh run each time
        command = runner_command(name, spec, lm, run_dir)
        result = spawn(command, Path(spec["out"]), env={**threads, "WANDB_MODE": "offline"}, log=log)
        weights = runner_weights(run_dir)
        metrics = json.loads((run_dir / "summary.json").read_text())["metrics"]
        result["own"] = {key: metrics.get(f"val/{key}") for key in ("fve", "kl_spliced", "ce_spliced", "l0")}
    else:
        spec = {**spec, "loss_fn": "kl" if name == "sparsify-kl" else "fvu", "lm": str(lm)}
        (out / f"{name}-probe.npy").unlink(missing_ok=True)  # the driver writes its logits there
        job = out / f"{name}-job.json"
        job.write_text(json.dumps(spec))
        script = ROOT / "benchmarks" / "peers" / "sparsify_kl_run.py"
        result = spawn([args.sparsify_python, str(script), str(job)], Path(spec["out"]), env=threads, log=log)
        from safetensors.torch import load_file

        weights = load_file(str(Path(spec["out"]).with_suffix(".safetensors")))
    result["samples_per_s"] = spec["rows_per_step"] / result["per_step_s"]
    # per second of the process's own CPU time: what a machine shared with other work moves least
    result["cpu_samples_per_s"] = spec["rows_per_step"] / result["cpu_step_s"]
    return {"result": result, "weights": weights}


def shared_forward(weights: dict[str, torch.Tensor], k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows -> the SAE's reconstruction in the shared form (float32, as runner's SpliceEval splices its SAE)."""
    w = {name: t.float() for name, t in weights.items()}

    def forward(x: torch.Tensor) -> torch.Tensor:
        xs = x.float() * w["scale"]
        pre = torch.addmm(w["b_enc"], xs - w["center"], w["W_enc"])
        values, indices = pre.topk(k, dim=1, sorted=False)
        recon = torch.nn.functional.embedding_bag(indices, w["W_dec"], per_sample_weights=values.relu(), mode="sum")
        return ((recon + w["b_dec"]) / w["scale"]).to(x.dtype)

    return forward


def score_all(lm: Path, layer: int, trained: dict[str, dict[str, torch.Tensor]], heldout: np.ndarray, k: int) -> dict:
    """Every trained SAE spliced into the GPT over its validation windows (one pass: the clean model, the zero and
    mean ablations, each SAE), plus FVE, L0 and never-firing latents on the held-out rows."""
    from experiments.sae.sources.source import SourceModel

    source = SourceModel(str(lm), f"blocks.{layer}", "cpu", skip_positions=SKIP)
    mean = torch.from_numpy(np.asarray(heldout)).mean(0)
    replacements = {"clean": None, "zero": torch.zeros_like, "mean": lambda out: mean.expand_as(out)}
    replacements.update({name: shared_forward(weights, k) for name, weights in trained.items()})
    losses = source.compare(replacements)
    clean, zero, ablated_mean = losses["clean"]["ce"], losses["zero"]["ce"], losses["mean"]["ce"]
    scores = {"clean_ce": clean, "zero_ce": zero, "mean_ce": ablated_mean}
    for name, weights in trained.items():
        got = losses[name]
        scores[name] = {
            "kl": got["kl"],
            "ce": got["ce"],
            "recovered_zero": (zero - got["ce"]) / (zero - clean),
            "recovered_mean": (ablated_mean - got["ce"]) / (ablated_mean - clean),
            **score(weights, heldout, k),
        }
    return scores


def check_model(lm: Path, ids: torch.Tensor, probe: Path | None = None) -> dict:
    """runner's GPT and its plain-torch rewrite (benchmarks/peers/gpt.py) give the same logits on `ids` (a batch of
    the lm's validation windows): here, and (`probe`: the logits sparsify's driver wrote in its own virtualenv)
    there."""
    from benchmarks.peers import gpt
    from runner.load import load_trained

    model, _ = load_trained(str(lm))
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(gpt.load(lm)(ids).logits, want, rtol=0, atol=0)
        if probe is not None:
            torch.testing.assert_close(torch.from_numpy(np.load(probe)), want, rtol=0, atol=0)
    names = {name for name, _ in model.named_modules()}
    if names != {name for name, _ in gpt.load(lm).named_modules()}:
        raise SystemExit("benchmarks/peers/gpt.py's module names differ from runner's GPT's")
    return {"logits_equal": True, "in_sparsify_venv": probe is not None, "probe_shape": list(ids.shape)}


def lm_probe_ids(lm: Path) -> torch.Tensor:
    """Four of the lm's validation windows' inputs (the probe both venvs run)."""
    from experiments.sae.sources.source import SourceModel

    source = SourceModel(str(lm), "blocks.0", "cpu")
    tokens = next(iter(source.data.val_loader()))["tokens"]
    return tokens[:4, :-1]


def profile(lm: Path, args: argparse.Namespace, out: Path) -> dict[str, dict[str, float]]:
    """Wall and CPU seconds a step of runner's kl training spends in each part: means over --profile-steps steps
    (after 3 warm-up steps) of the real Spliced.training_step in this process, one thread. Timers around
    SourceModel.loss (its call under no_grad is the clean forward, the other the spliced one), around the SAE's step,
    and around the GPT's top modules (embed, blocks.i, norm, head: up to the hook point, and after it), each counted
    in the pass it ran in; then the backward, the optimizer step and the SAE's constraint. Apart, untimed in the step:
    the SAE's own backward on the same batch's rows (the rest of the backward is the frozen later blocks')."""
    from runner.build import build

    # callbacks=none: no spliced validation, so none of its val/kl_spliced for the preset's monitor
    overrides = [*kl_overrides(lm, args, args.seeds[0]), "callbacks=none", "monitor=val/fve", "logger=none"]
    overrides.append("checkpoint=none")
    run = build(_compose([*overrides, f"run_dir={out / 'profile-run'}", "distributed.device=cpu"]))
    task, optimizer, source = run.task, run.optimizer, run.task.source
    times: dict[str, tuple[float, float]] = {}  # part -> (wall, CPU) seconds over the timed steps
    on = [True]  # off while the parts apart run (their forwards are no pass of the step)

    def add(part: str, wall: float, cpu: float) -> None:
        if on[0]:
            wall_s, cpu_s = times.get(part, (0.0, 0.0))
            times[part] = (wall_s + time.perf_counter() - wall, cpu_s + time.process_time() - cpu)

    def clock(part: str, fn: Callable, *a, **kw):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn(*a, **kw)
        add(part, wall, cpu)
        return result

    def module_timer(name: str, where: str) -> None:
        started: list[tuple[float, float]] = []
        module = source.model.get_submodule(name)
        module.register_forward_pre_hook(lambda *_: started.append((time.perf_counter(), time.process_time())))
        # registered first: it runs before any splice's hook on the module (the SAE's step is timed on its own)
        module.register_forward_hook(lambda *_: add(_pass() + where, *started.pop()))

    def _pass() -> str:
        return "spliced " if torch.is_grad_enabled() else "clean "

    n_layer = len(source.model.blocks)
    for name in ["embed", *(f"blocks.{i}" for i in range(n_layer)), "norm", "head"]:
        before = name == "embed" or (name.startswith("blocks.") and int(name.split(".")[1]) <= args.layer)
        module_timer(name, "up to the hook" if before else "after the hook")
    loss, step = source.loss, task.coder.step
    source.loss = lambda b: clock(_pass() + "forward", loss, b)
    task.coder.step = lambda *a, **kw: clock("SAE step", step, *a, **kw)

    def optimize() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        task.after_optimizer_step()

    batches = iter(run.train_loader)
    for i in range(3 + args.profile_steps):
        if i == 3:
            times.clear()
        batch = next(batches)
        result = clock("training_step", task.training_step, batch)
        clock("backward", result["loss"].backward)
        clock("optimizer + constraint", optimize)
        if i >= 3:  # apart: the SAE's own backward on this batch's rows
            on[0] = False
            rows = source.activations(batch)
            on[0] = True
            clock("SAE backward alone", step(rows, train=False)[0]["recon_loss"].backward)
            optimizer.zero_grad(set_to_none=True)
    source.loss, task.coder.step = loss, step
    return {
        name: _parts({part: both[i] / args.profile_steps for part, both in times.items()})
        for i, name in enumerate(("wall_s", "cpu_s"))
    }


def _parts(t: dict[str, float]) -> dict[str, float]:
    # the step's parts from the timers; a part no timer saw (the spliced pass's prefix, replayed) counts 0
    def get(part: str) -> float:
        return t.get(part, 0.0)

    clean = get("clean up to the hook") + get("clean after the hook")
    spliced = get("spliced up to the hook") + get("SAE step") + get("spliced after the hook")
    parts = {
        "clean forward: embedding and blocks up to the hook point": get("clean up to the hook"),
        "clean forward: later blocks, norm, head": get("clean after the hook"),
        "spliced forward: embedding and blocks up to the hook point": get("spliced up to the hook"),
        "spliced forward: the SAE's step": get("SAE step"),
        "spliced forward: later blocks, norm, head": get("spliced after the hook"),
        "the passes' losses, KL, the rest of training_step": get("training_step") - clean - spliced,
        "backward: frozen later blocks and head": get("backward") - get("SAE backward alone"),
        "backward: the SAE's own": get("SAE backward alone"),
        "optimizer + constraint": get("optimizer + constraint"),
    }
    total = get("training_step") + get("backward") + get("optimizer + constraint")
    return {**parts, "step": total, "backward": get("backward")}


def main() -> None:
    """Prepare the windows once, train every contender for every seed in rotating order, score, profile, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm", help="a finished +experiment=lm run folder (default: train one into --dir)")
    parser.add_argument("--lm-args", nargs="*", default=[], help="overrides of the GPT trained without --lm")
    parser.add_argument("--layer", type=int, default=2, help="the hook point: blocks.LAYER, the residual stream")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    parser.add_argument("--sparsify-python", default=str(ROOT / ".venv-sparsify" / "bin" / "python"))
    parser.add_argument("--n-latents", type=int, default=2048)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--windows", type=int, default=8, help="windows per step (runner's data.batch_size in kl)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile-steps", type=int, default=20, help="0: no profile")
    parser.add_argument("--dir", default="outputs/bench-sae-kl")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.steps < 10:
        raise SystemExit(f"--steps {args.steps}: give 10 or more (the steady state is timed over 10 stretches)")
    if any(name.startswith("sparsify") for name in args.contenders) and not Path(args.sparsify_python).exists():
        raise SystemExit(
            f"no sparsify interpreter at {args.sparsify_python}: make it with benchmarks/peers/install.sh, give "
            "--sparsify-python, or leave sparsify-kl and sparsify-recon out of --contenders"
        )
    torch.set_num_threads(args.threads)
    out = Path(args.dir).resolve()
    lm = lm_run(args, out)
    files = write_data(lm, args, out / "data")
    seq_len = int(np.load(files[f"windows{args.seeds[0]}"], mmap_mode="r").shape[1]) - 1
    rows_per_step = args.windows * (seq_len - SKIP)
    results: dict[str, list[dict]] = {name: [] for name in args.contenders}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for i, seed in enumerate(args.seeds):
        spec = {
            **{"windows": str(files[f"windows{seed}"]), "heldout": str(files["heldout"]), "layer": args.layer},
            "probe": str(files["probe"]),
            **{"hookpoint": f"blocks.{args.layer}", "skip_positions": SKIP, "seed": seed, "threads": args.threads},
            **{"n_latents": args.n_latents, "k": args.k, "batch": args.windows, "rows_per_step": rows_per_step},
            **{"lr": args.lr, "steps": args.steps, "lr_warmup_steps": max(1, round(0.01 * args.steps))},
            **{"warmup_steps": args.steps // 10, "auxk_coeff": AUXK, "dead_tokens": DEAD_TOKENS},
            "device": args.device,
        }
        order = args.contenders[i % len(args.contenders) :] + args.contenders[: i % len(args.contenders)]
        seed_dir = out / f"seed{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        for name in order:
            got = run_one(name, spec, args, lm, seed_dir)
            results[name].append(got["result"])
            weights[f"{name}/{seed}"] = got["weights"]
            print(f"seed {seed} {name}: {got['result']['samples_per_s']:.0f} samples/s", flush=True)
    probes = [out / f"seed{s}" / f"{n}-probe.npy" for s in args.seeds for n in args.contenders if "sparsify" in n]
    probe = probes[0] if probes else None
    check = check_model(lm, torch.from_numpy(np.load(files["probe"])), probe)
    heldout = np.load(files["heldout"])
    scores = score_all(lm, args.layer, weights, heldout, args.k)
    for name, runs in results.items():
        for seed, run in zip(args.seeds, runs, strict=True):
            run["score"] = scores[f"{name}/{seed}"]
    timing = profile(lm, args, out) if args.profile_steps else None
    print_tables(results, scores, timing, args, rows_per_step)
    write_json(
        args.json,
        {
            **{"device": args.device, "machine": machine(), "threads": args.threads, "steps": args.steps},
            **{"rows_per_step": rows_per_step, "args": vars(args), "model_check": check},
            **{"ablations": {key: scores[key] for key in ("clean_ce", "zero_ce", "mean_ce")}},
            **{"results": results, "profile": timing},
        },
    )


def print_tables(
    results: dict[str, list[dict]], scores: dict, timing: dict | None, args: argparse.Namespace, rows: int
) -> None:
    """The side-by-side (medians over seeds; samples/s paired per seed against runner-kl) and the profile."""
    print(
        f"\n{machine()}, device {args.device}, {args.threads} thread(s); blocks.{args.layer}, "
        f"{args.n_latents} latents, k {args.k}, {args.windows} windows ({rows} rows) a step, {args.steps} steps, "
        f"Adam {args.lr}, seeds {args.seeds}; clean CE {scores['clean_ce']:.4f}, zero-ablated "
        f"{scores['zero_ce']:.4f}, mean-ablated {scores['mean_ce']:.4f}\n"
    )
    print(
        "| contender | spliced KL | spliced CE | recovered (zero) | recovered (mean) | FVE | L0 | never fire | "
        "samples/s | runner-kl / it | samples per CPU s | runner-kl / it | runner's own KL |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def paired(runs: list[dict], key: str) -> str:  # runner-kl's rate over this one's, per seed, median
        base = [r[key] for r in results.get("runner-kl", [])]
        return f"{statistics.median(b / r[key] for b, r in zip(base, runs, strict=True)):.2f}" if base else "-"

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r["score"][key] for r in runs)

    for name, runs in results.items():
        own = [r["own"]["kl_spliced"] for r in runs if r.get("own", {}).get("kl_spliced") is not None]
        print(
            f"| {name} | {med(runs, 'kl'):.4f} | {med(runs, 'ce'):.4f} | {med(runs, 'recovered_zero'):.4f} | "
            f"{med(runs, 'recovered_mean'):.4f} | {med(runs, 'fve'):.4f} | {med(runs, 'l0'):.1f} | "
            f"{max(r['score']['dead'] for r in runs):.4f} | "
            f"{statistics.median(r['samples_per_s'] for r in runs):.0f} | {paired(runs, 'samples_per_s')} | "
            f"{statistics.median(r['cpu_samples_per_s'] for r in runs):.0f} | {paired(runs, 'cpu_samples_per_s')} | "
            + (f"{statistics.median(own):.4f} |" if own else "- |")
        )
    if timing:
        wall, cpu = timing["wall_s"], timing["cpu_s"]
        print(f"\nrunner's kl step, {args.profile_steps} steps in this process (ms a step, share of the step):\n")
        print("| part | wall ms | share | CPU ms | share |")
        print("| --- | --- | --- | --- | --- |")
        for part in wall:
            print(
                f"| {part} | {1000 * wall[part]:.1f} | {wall[part] / wall['step']:.1%} | {1000 * cpu[part]:.1f} | "
                f"{cpu[part] / cpu['step']:.1%} |"
            )
        print(
            f"\nthe backward's share: {wall['backward'] / wall['step']:.1%} "
            f"(CPU time {cpu['backward'] / cpu['step']:.1%})"
        )


if __name__ == "__main__":
    main()
