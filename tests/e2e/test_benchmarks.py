"""The benchmark scripts run end to end in a tiny smoke mode, so that they do not rot."""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, ok, python, read_json

SPARSIFY = ROOT / ".venv-sparsify" / "bin" / "python"
STDLIB = Path(sysconfig.get_paths()["stdlib"])  # benchmarks/peers/install.sh makes it; CI has none
# sae_kl trains the GPT the way a user's first run does (--lm-args: 4 steps of a 2-block GPT on one stdlib package);
# startup_sae and sae_init read that run (--lm): its blocks 0 and 1 are their --layer choices, and the LM's training
# is no part of any script's figures
TINY_GPT = [
    *("model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.batch_size=2"),
    *("trainer.max_duration=4st", "data.val_every=2", "data.cache_dir=cache"),
    f"data.paths=[{STDLIB / 'json' / '*.py'}]",
]
READS_GPT = {"startup_sae", "sae_init"}
# script -> its smoke arguments (sae_kl, whose GPT two others read, then the slowest first: they start in this order).
# Every script runs with --device cpu: the checks below are the CPU's (identical losses and decoders, no MFU), also on
# a machine with a GPU.
SMOKE = {
    # TINY_GPT, then 12 steps of 2 windows a step of SAEs of 64 latents (k 4) on its blocks.0, trained by KL through
    # block 1 and by reconstruction; sparsify's too where its virtualenv is
    "sae_kl": [
        *("--n-latents", "64", "--k", "4", "--windows", "2", "--steps", "12", "--layer", "0", "--seeds", "0"),
        *("--profile-steps", "2", "--dir", "out"),
        # CI: runner's alone; runner-kl-compiled (compile=blocks) is tested in tests/unit/test_end_to_end.py
        *(
            "--contenders",
            "runner-kl",
            "runner-recon",
            *(("sparsify-kl", "sparsify-recon") if SPARSIFY.exists() else ()),
        ),
        *("--lm-args", *TINY_GPT),
    ],
    # DDP with no_sync accumulation, runner and hand-written, and their one-process baselines: four jobs, two of them
    # torchrun with 2 processes (all nine take over a minute of startup on 2 busy cores)
    "ddp": ["--smoke", "--contenders", "ddp_acc", "hand_ddp_acc"],
    # past the first epoch (64 steps on tiny): the losses check covers each contender's reshuffle at an epoch's start
    "overhead": ["--steps", "70", "--warmup", "10", "--reps", "1", "--sizes", "tiny"],
    "startup": ["--steps", "3", "--reps", "1"],
    # 4 SAE steps of each contender on blocks.1 of sae_kl's GPT
    "startup_sae": ["--steps", "4", "--reps", "1", "--threads", "1", "--layer", "1"],
    # a 2-block GPT of width 64 over 2 ranks, a checkpoint every 2 of its 4 steps, in each format
    "checkpoint_dcp": ["--ranks", "2", "--width", "64", "--layers", "2", "--steps", "4", "--interval", "2"],
    # two log windows of digits (the steady state is the second), fused and not
    "fused": ["--only", "digits", "--steps", "20", "--reps", "1"],
    # Matryoshka on BatchTopK codes: the most SAE code on one path (TopK is the default's, trained by other tests)
    "sae_throughput": ["--model", "matryoshka", "--steps", "4", "--reps", "1", "--batch", "256"],
    # runner's SAE step with its torch and its Triton kernels, these in Triton's interpreter (tests/conftest.py sets
    # TRITON_INTERPRET=1 without a GPU, and the scripts inherit it); sparsify's row needs its virtualenv's python
    "sae_kernels": [
        *("--precision", "fp32", "--d", "32", "--n-latents", "256", "--k", "4", "--batch", "64"),
        *("--steps", "2", "--reps", "2", "--warmup", "1"),
    ],
    # a one-block source, a ring of 2048 positions refilled every 8 steps of 128
    "sae_multi": ["--n-layer", "1", "--cycles", "1", "--reps", "1", "data.buffer_size=2048", "data.batch_size=128"],
    # a 2-block GPT-2 of width 64 (GPT-2's vocabulary) as a transformers source
    "sae_hf": ["--n-layer", "2", "--n-embd", "64", "--layer", "1", "--windows", "8", "--batch", "4", "--context", "16"],
    # a one-block source; 5,000 rows in shards of 2,048
    "sae_cache": ["--rows", "5000", "--shard-rows", "2048", "--n-layer", "1", "--layer", "0"],
    # each variant on 2,048 activations of sae_kl's GPT's blocks.0
    "sae_init": [
        *("model.n_latents=64", "model.k=4", "scheduler.decay=0.5dur"),  # the SAEs'
        *("--variants", "unit-norm encoder", "fit encoder scale", "norm 0.5 (default)"),  # 3 of the 7 processes
        *("--seeds", "0", "--rows", "2048", "--batch", "256", "--layer", "0", "--dir", "out"),
    ],
    # a one-block d-32 source on one stdlib package, a ring of 2048 refilled every 4 steps of 256, hand against runner
    "sae_pipeline": [
        *("--shape", "lm", "--cycles", "1", "--reps", "2", "data.buffer_size=2048", "data.batch_size=256"),
        *("--source-args", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32"),
    ],
    "checkpoint": ["--sizes", "5", "--reps", "2"],
    "muon": ["--d", "16", "--n-latents", "64", "--steps", "2", "--reps", "2"],
    # an SAELens-layout SAE on a 1-block GPT-2 of width 32 (a 400-token BPE of one stdlib package), every evaluation
    "sae_eval": [
        *("--gpt2", "gpt2", "--n-layer", "1", "--n-embd", "32", "--vocab", "400", "--latents", "64", "--k", "4"),
        *("--layer", "0", "--tokens", "2000", "--corpus", *map(str, sorted(STDLIB.glob("json/*.py")))),
    ],
    # 3 layers of 16, 32 latents a layer: the CLT and its per-layer transcoders, 12 steps each
    "clt": ["--layers", "3", "--d", "16", "--n-latents", "32", "--k", "4", "--batch", "64", "--steps", "12"],
    # a family of 4 SAEs of 64 latents on 16-wide rows, replicated and spread over 2 ranks, 4 steps each
    "spread": [
        *("--ranks", "2", "--steps", "4", "model.base.n_latents=64", "data.splits.d=16", "data.splits.n_features=32"),
        "data.batch_size=64",
    ],
    "stream": [
        "--batches",
        "20",
        "--reps",
        "1",
        "--paths",
        str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"),
    ],
    # a one-layer GPT on one stdlib package; eager and activation checkpointing (compiling takes ~30 s from cold)
    "lm": [
        *("--modes", "eager,ac", "--steps", "4", "--warmup", "2", "--reps", "1", "--threads", "1"),
        *("model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.batch_size=2"),
        *(f"data.paths=[{Path(sysconfig.get_paths()['stdlib']) / 'json' / '*.py'}]", "data.cache_dir=cache"),
    ],
}


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], dict]]:
    """The module's runs (helpers.module_runs): every script of SMOKE once (one thread per process), its --json; the
    scripts of READS_GPT wait for sae_kl's GPT."""

    def job(name: str) -> Callable[[], dict]:
        def run() -> dict:
            (root / name).mkdir()
            out, args = root / name / "out.json", SMOKE[name]
            extra = ["--device", "cpu", *(["--dir", str(root / name)] if name == "checkpoint" else [])]
            if name in READS_GPT:
                runs["sae_kl"].result()
                extra += ["--lm", str(root / "sae_kl" / "out" / "lm")]
            script = str(ROOT / "benchmarks" / f"{name}.py")
            ok(python(script, *args, *extra, "--json", str(out), cwd=root / name, timeout=600))
            return {**read_json(out), "cwd": root / name}

        return run

    def ddp_without_gpus() -> dict:
        # No GPU visible: ddp.py --device cuda says why in one line and exits with 2, not a crash inside torchrun
        (root / "ddp_cuda").mkdir()
        script = str(ROOT / "benchmarks" / "ddp.py")
        proc = python(script, "--device", "cuda", cwd=root / "ddp_cuda", env={"CUDA_VISIBLE_DEVICES": ""})
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    def sae_peers() -> dict:
        # runner alone (CI has no peers' virtualenvs) on a small file: 12 steps of 256, 1,024 rows held out; then a
        # peer whose interpreter is missing, which must say how to make it; then runner's transcoders, with and
        # without a skip connection, on rows [x | y] whose last 8 columns are the target
        folder = root / "sae_peers"
        folder.mkdir()
        rows = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0)) @ torch.randn(16, 16) + 1
        np.save(folder / "acts.npy", rows.numpy())
        np.save(folder / "pairs.npy", torch.cat([rows, rows[:, :8].relu() @ torch.randn(8, 8)], 1).numpy())
        script, out, tc = str(ROOT / "benchmarks" / "sae_peers.py"), folder / "out.json", folder / "transcoder.json"
        sizes = ["--n-latents", "64", "--k", "4", "--batch", "256", "--steps", "12", "--dead-steps", "4"]
        common = ["--heldout", "1024", "--seeds", "0", *sizes]
        args = ["--acts", "acts.npy", *common, "--dir", "bench"]
        ok(python(script, *args, "--contenders", "runner", "--json", str(out), cwd=folder, timeout=600))
        missing = python(script, *args, "--contenders", "sparsify", "--sparsify-python", "nowhere/python", cwd=folder)
        pairs = ["--acts", "pairs.npy", "--target-columns", "8", *common, "--dir", "bench-tc", "--json", str(tc)]
        ok(python(script, *pairs, "--contenders", "runner", "runner-skip", cwd=folder, timeout=600))
        no_target = python(script, *args, "--contenders", "runner-skip", cwd=folder)
        return {
            **read_json(out),
            "missing": {"returncode": missing.returncode, "stderr": missing.stderr},
            "transcoder": read_json(tc),
            "no_target": {"returncode": no_target.returncode, "stderr": no_target.stderr},
        }

    scripts = {name: job(name) for name in SMOKE}
    return {**scripts, "ddp_cuda": ddp_without_gpus, "sae_peers": sae_peers}


def test_every_script_names_its_device(runs: dict[str, Future]) -> None:
    for name in SMOKE:
        assert runs[name].result()["device"] == "cpu", name


def test_ddp_on_cuda_needs_two_gpus(runs: dict[str, Future]) -> None:
    result = runs["ddp_cuda"].result()
    assert result["returncode"] == 2, result
    assert "Traceback" not in result["stderr"], result
    assert "needs 2 GPUs with NCCL" in result["stderr"].strip().splitlines()[-1], result


def test_overhead_smoke(runs: dict[str, Future]) -> None:
    result = runs["overhead"].result()
    tiny = result["sizes"]["tiny"]
    assert set(tiny["contenders"]) == {"hand", "runner", "lightning", "runner_usual", "lightning_usual"}
    # The same arithmetic in every contender: a correctness check, not only a speed one.
    assert tiny["losses_agree"], tiny
    assert tiny["final_loss_max_diff"] == 0.0, tiny  # hand, runner and lightning: identical, not only close
    losses = {row["final_loss"] for row in tiny["contenders"].values()}
    assert max(losses) - min(losses) < 1e-5
    for row in tiny["contenders"].values():
        assert row["us_per_step"]["median"] > 0 and row["peak_rss_mb"] > 100
    assert tiny["contenders"]["hand"]["ratio_to_hand"]["median"] == 1.0
    # What runner's step launches beyond the hand loop's: the non-finite flag (x * 0, nan_to_num) of the window's loss
    # plus the norm it checks, and the fused AdamW's own undoing of a skipped step's count for that flag (one
    # _foreach_sub_ a parameter group: two); a new device op on the hot path shows here first.
    ops = {name: row["ops_per_step"] for name, row in tiny["contenders"].items()}
    assert ops["hand"] > 20 and 0 <= ops["runner"] - ops["hand"] <= 5, ops
    assert ops["runner_usual"] == ops["runner"], ops  # its console, log file and checkpoints add none


def test_startup_smoke(runs: dict[str, Future]) -> None:
    result = runs["startup"].result()
    for name in ("hand", "runner", "runner_usual"):
        row = result["contenders"][name]
        assert 0 < row["to_first_step_s"]["median"] < row["wall_s"]["median"]
    assert 0 < result["imports_hydra_s"]["median"] <= result["imports_all_s"]["median"]
    assert result["compose_compose_s"]["median"] > 0


def test_startup_sae_smoke(runs: dict[str, Future]) -> None:
    result = runs["startup_sae"].result()
    for name in ("hand", "runner", "runner_once"):
        row = result["contenders"][name]
        assert 0 < row["training_s"]["median"] < row["wall_s"]["median"], (name, row)
        assert row["metrics"]["val/fve"]["median"] <= 1 and row["metrics"]["val/ce_spliced"]["median"] > 0
    # the same training; validations along the way (a quarter of the split) leave the final figures as one at the end
    runner, once = (result["contenders"][name]["metrics"] for name in ("runner", "runner_once"))
    assert runner == once, (runner, once)
    phases = dict(result["contenders"]["runner"]["phases"])
    assert {"validation", "splice setup", "source model", "buffer fill", "first step"} <= set(phases), phases


def test_checkpoint_dcp_smoke(runs: dict[str, Future]) -> None:
    rows = {row["format"]: row for row in runs["checkpoint_dcp"].result()["rows"]}
    assert {"files", "dcp"} <= set(rows), rows
    assert all(row["hwm_mb"] > 0 for row in rows.values()), rows
    for name in ("files", "dcp", "dcp_async"):
        assert rows[name]["saves"] >= 2 and rows[name]["wait_per_save_s"] > 0 and rows[name]["resume_s"] > 0, rows


def test_fused_smoke(runs: dict[str, Future]) -> None:
    # the two settings train the same digits run: both measured, losses within what the kernels' rounding moves
    row = runs["fused"].result()["workloads"]["digits"]
    fused, loop = row["fused (default)"], row["for-loop (fused=false)"]
    assert fused["samples_per_s"] > 0 and loop["samples_per_s"] > 0 and row["ratio"]["median"] > 0
    assert fused["loss"] == pytest.approx(loop["loss"], rel=1e-4)


def test_sae_throughput_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_throughput"].result()
    assert result["max_decoder_diff"] == 0.0
    assert result["shape"] == {"d_in": 256, "n_latents": 1024, "k": 5, "batch": 256} and result["mfu"] is None  # CPU
    assert result["model"] == "matryoshka"
    assert result["hand_samples_per_s"] > 0 and result["runner_samples_per_s"] > 0
    # both encoder backwards (the Triton one is sae_kernels' below), each run by both loops: identical decoders
    assert set(result["backward"]) == {"dense", "sparse"} and set(result["over_dense"]) == {"sparse"}
    assert set(result["over_dense"]["sparse"]) == {"hand", "runner"}
    assert all(figures["max_decoder_diff"] == 0.0 for figures in result["backward"].values())


def test_sae_kernels_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_kernels"].result()
    assert set(result["contenders"]) == {"runner torch", "runner triton"}  # no sparsify in this python
    for row in result["contenders"].values():
        assert len(row["all"]) == 2 and row["min"] <= row["samples_per_s"] <= row["max"] and row["min"] > 0


def test_sae_multi_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_multi"].result()
    assert result["steps_timed"] == 8 and result["layer"] == 0
    assert result["one_s"] > 0 and result["four_s"] > 0
    assert result["ratio"] == result["four_s"] / result["one_s"]  # one repetition: its ratio is the medians'
    assert 0 < result["source_share_of_one"] < 1


def test_sae_hf_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_hf"].result()
    assert all(rate > 0 for rate in result["positions_per_s"].values()) and result["ratio"] > 0, result
    # what a GPU holds: the source's float32 weights (GPT-2's vocabulary x 64, tied) and the 1,024-latent SAE's
    assert result["gpu_memory_mb"]["source_weights"] > 50257 * 64 * 4 / 1e6
    assert result["gpu_memory_mb"]["sae_weights_grads_adam"] == round(4 * 2 * 64 * 1024 * 4 / 1e6)


def test_sae_cache_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_cache"].result()
    assert result["rows"] == 5000 and result["d"] == 128 and result["mb"] == 5000 * 128 * 4 / 1e6
    for name in ("forward", "write", "read_warm", "read_cold"):
        assert result[f"{name}_rows_per_s"] > 0 and result[f"{name}_mb_per_s"] > 0, name


def test_stream_smoke(runs: dict[str, Future]) -> None:
    result = runs["stream"].result()
    assert result["batches"] == 20 and set(result["workers"]) == {"0", "2"}
    for row in result["workers"].values():
        assert row["runner"] > 0 and row["plain"] > 0 and row["ratio"] == row["runner"] / row["plain"]


def test_sae_init_smoke(runs: dict[str, Future]) -> None:
    results = runs["sae_init"].result()["results"]
    assert set(results) == {"unit-norm encoder", "fit encoder scale", "norm 0.5 (default)"}  # --variants
    for name, (run,) in results.items():  # one seed: each variant trained and validated, with its codes' L0
        assert math.isfinite(run["fve"]) and run["l0"] == 4, name
        assert 0 <= run["dead_fraction"] <= 1 and 0 <= run["silent_fraction"] <= 1, name


def test_sae_peers_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_peers"].result()
    (run,) = result["results"]["runner"]
    assert result["steps"] == 12 and set(result["results"]) == {"runner"}
    # the shared scorer (float64, from the saved weights) agrees with runner's own validation on the held-out file
    # (float32 there: a near-tie in the top-k may go the other way, measured 2e-5 apart after 12 steps)
    assert run["score"]["fve"] == pytest.approx(run["own"]["fve"], abs=2e-4) and 0 < run["score"]["fve"] < 1
    assert run["score"]["l0"] == 4 and 0 <= run["score"]["dead"] < 1
    assert run["samples_per_s"] > 0 and run["to_first_step_s"] > 0 and run["own_peak_rss_mb"] > 100
    missing = result["missing"]
    assert missing["returncode"] == 1 and "benchmarks/peers/install.sh" in missing["stderr"]
    # transcoders: the shared scorer (the rows' last 8 columns predicted from the other 16, W_skip and the target's
    # scale from runner's weights) agrees with runner's own validation of the target on the held-out file
    transcoder = result["transcoder"]
    assert set(transcoder["results"]) == {"runner", "runner-skip"} and transcoder["args"]["target_columns"] == 8
    for name, (run,) in transcoder["results"].items():
        assert run["score"]["fve"] == pytest.approx(run["own"]["fve"], abs=2e-4), name
        assert run["score"]["l0"] <= 4 and 0 <= run["score"]["dead"] < 1 and run["samples_per_s"] > 0, name
    no_target = result["no_target"]
    assert no_target["returncode"] == 1 and "give --target-columns" in no_target["stderr"]


def test_sae_pipeline_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_pipeline"].result()
    assert result["steps_timed"] == 4 and result["layer"] == 0 and result["buffer_size"] == 2048
    assert result["hand_samples_per_s"] > 0 and result["runner_samples_per_s"] > 0 and len(result["ratios"]) == 2
    assert result["peak_gpu_mb"] == {"hand": None, "runner": None}  # on the CPU: no GPU figure


def test_checkpoint_smoke(runs: dict[str, Future]) -> None:
    result = runs["checkpoint"].result()
    row = result["sizes"]["5.0"]
    assert 3 < row["state_mb"] < 8
    assert 0 < row["blocked_ms"] and 0 < row["sync_ms"] and row["written_ms"] >= row["blocked_ms"]
    assert row["resume_ms"] > 0


def test_muon_smoke(runs: dict[str, Future]) -> None:
    result = runs["muon"].result()
    assert result["shapes"] == [[64, 16], [16, 64]] and isinstance(result["bf16_native"], bool)
    assert set(result["rows"]) == {"adam", "muon bfloat16", "muon float32", "muon (ns_dtype null)"}
    assert all(row["ms_per_step"] > 0 for row in result["rows"].values())
    assert result["rows"]["adam"]["vs_adam"] == 1.0


def test_ddp_smoke(runs: dict[str, Future]) -> None:
    result = runs["ddp"].result()
    rows = result["contenders"]
    assert set(rows) == {"ddp_acc", "single_acc", "hand_ddp_acc", "hand_single_acc"}
    assert rows["ddp_acc"]["layout"] == "2 x 32 x 4" and rows["single_acc"]["layout"] == "1 x 64 x 4"
    assert set(result["ratios"]) == {
        *("ddp_acc / single_acc", "hand_ddp_acc / hand_single_acc"),
        *("single_acc / hand_single_acc", "ddp_acc / hand_ddp_acc"),
    }
    assert result["losses_agree"] and result["ranks_agree"]
    for row in rows.values():
        assert math.isfinite(row["ms_per_step"]["median"]) and row["ms_per_step"]["median"] > 0
        assert math.isfinite(row["ratio_to_baseline"]["median"]) and row["ratio_to_baseline"]["median"] > 0
        assert 0 < row["to_first_step_s"]["median"] < row["wall_s"]["median"]
        assert row["rank_peak_rss_mb"] > 100


def test_lm_smoke(runs: dict[str, Future]) -> None:
    result = runs["lm"].result()
    assert set(result["modes"]) == {"eager", "ac"}
    losses = {row["final_loss"] for mode in result["modes"].values() for row in mode.values()}
    assert len(losses) == 1  # hand and runner, with and without checkpointing: the same arithmetic, the same loss
    for mode in result["modes"].values():
        assert mode["runner"]["tokens_per_s"] > 0 and mode["hand"]["ratio_to_hand"] == 1.0
    # data.cache_dir=cache is relative to where the benchmark was started, as any path a user gives it (its runs
    # wrote into the repository once)
    assert list((result["cwd"] / "cache").glob("*/train.u8")), sorted(result["cwd"].rglob("*"))


def test_clt_smoke(runs: dict[str, Future]) -> None:
    results = runs["clt"].result()["results"]
    # the parameters the memory formula counts: per layer an encoder (16 x 32 + 32); decoders to 3 layers (per-layer)
    # or to 3 + 2 + 1 (the CLT), each 32 x 16 + 16
    assert results["per_layer"]["params"] == 3 * (16 * 32 + 32) + 3 * (32 * 16 + 16)
    assert results["clt"]["params"] == 3 * (16 * 32 + 32) + 6 * (32 * 16 + 16)
    assert all(r["step_ms"] > 0 and r["peak_mb"] > 100 for r in results.values())


def test_spread_smoke(runs: dict[str, Future]) -> None:
    ddp, spread = runs["spread"].result()["rows"]
    assert (ddp["strategy"], spread["strategy"], ddp["ranks"], spread["ranks"]) == ("ddp", "spread", 2, 2)
    # 4 SAEs of 16 x 64 (+ biases) in fp32 with gradients and Adam's two moments (and its step count, a float32 per
    # tensor): all of them, or two per rank
    family = (4 * (2 * 16 * 64 + 64 + 16) * 4 * 4 + 4 * 4 * 4) / 2**20
    assert ddp["sae_state_mb"] == pytest.approx(family) and spread["sae_state_mb"] == pytest.approx(family / 2)
    assert ddp["samples_per_s"] > 0 and spread["samples_per_s"] > 0


def test_sae_eval_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_eval"].result()
    gpt2 = result["gpt2"]
    assert set(gpt2["seconds"]) == {"core", "probing", "absorption"} and gpt2["read"]["core"]["positions"] >= 2000
    assert gpt2["peak_rss_mb"] > 0 and "AVX" in result["cpu"]


def test_sae_kl_smoke(runs: dict[str, Future]) -> None:
    result = runs["sae_kl"].result()
    # the plain-torch GPT sparsify trains gives runner's GPT's logits exactly (in sparsify's virtualenv too, if there)
    sparsify = SPARSIFY.exists()
    assert result["model_check"]["logits_equal"] and result["model_check"]["in_sparsify_venv"] == sparsify
    names = {"runner-kl", "runner-recon"} | ({"sparsify-kl", "sparsify-recon"} if sparsify else set())
    assert set(result["results"]) == names and result["rows_per_step"] == 2 * 31  # 2 windows of 32, less the first
    ablations = result["ablations"]
    assert ablations["zero_ce"] > ablations["clean_ce"] and ablations["mean_ce"] > ablations["clean_ce"]
    for name, (run,) in result["results"].items():
        got = run["score"]
        assert got["l0"] == 4 and 0 <= got["dead"] < 1 and 0 < got["fve"] < 1 and got["kl"] > 0, name
        assert got["recovered_zero"] == pytest.approx(
            (ablations["zero_ce"] - got["ce"]) / (ablations["zero_ce"] - ablations["clean_ce"])
        )
        assert run["samples_per_s"] > 0 and run["cpu_samples_per_s"] > 0, name
        if name.startswith("runner"):  # the shared scorer agrees with runner's own validation (SpliceEval, FVE)
            assert got["kl"] == pytest.approx(run["own"]["kl_spliced"], rel=1e-6), name
            assert got["ce"] == pytest.approx(run["own"]["ce_spliced"], rel=1e-6), name
            assert got["fve"] == pytest.approx(run["own"]["fve"], abs=2e-4), name
        else:  # and with sparsify's own forward (its FVE), through the shared form
            assert got["fve"] == pytest.approx(run["own"]["fve"], abs=2e-4), name
    for profile in result["profile"].values():  # wall and CPU seconds
        assert profile["step"] > 0 and 0 < profile["backward"] < profile["step"], profile
        assert profile["spliced forward: the SAE's step"] > 0 and profile["clean forward: later blocks, norm, head"] > 0
