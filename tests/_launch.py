"""Runs `python -m runner` with test-only slowdowns, so that a test can kill it at a chosen moment.

    python tests/_launch.py [overrides...]
RUNNER_TEST_STEP_SLEEP=s     sleep s seconds in every training_step (the run lasts long enough to be signalled)
RUNNER_TEST_SLOW_SAVE=name:s sleep s seconds before writing the files of checkpoint folder `name` (a save in flight)
RUNNER_TEST_DESYNC=n:name    after optimizer step n, rank 1 nudges parameter `name` (ranks silently diverge)
"""

import os
import runpy
import time

import runner.checkpoint

import runner.loop

if os.environ.get("RUNNER_TEST_STEP_SLEEP"):
    pause = float(os.environ["RUNNER_TEST_STEP_SLEEP"])
    fit = runner.loop.fit

    def slow_fit(run):
        step = run.task.training_step

        def slow_step(batch):
            time.sleep(pause)
            return step(batch)

        run.task.training_step = slow_step
        return fit(run)

    runner.loop.fit = slow_fit

if os.environ.get("RUNNER_TEST_SLOW_SAVE"):
    name, seconds = os.environ["RUNNER_TEST_SLOW_SAVE"].split(":")
    write = runner.checkpoint._write_synced

    def slow_write(path, data):
        if path.parent.name == f".tmp-{name}":
            time.sleep(float(seconds))
        write(path, data)

    runner.checkpoint._write_synced = slow_write

if os.environ.get("RUNNER_TEST_DESYNC"):
    import torch

    from runner.run import Callback

    at, target = os.environ["RUNNER_TEST_DESYNC"].split(":")
    fit_desync = runner.loop.fit

    class Desync(Callback):
        def on_optimizer_step(self, run):
            if run.progress.step == int(at) and run.strategy.rank == 1:
                with torch.no_grad():
                    dict(run.task.named_parameters())[target].view(-1)[0] += 1e-6

    def desync_fit(run):
        run.callbacks.append(Desync())
        return fit_desync(run)

    runner.loop.fit = desync_fit

runpy.run_module("runner", run_name="__main__")
