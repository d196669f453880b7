"""Callbacks: the options of the `callbacks` config group, one module each (the hooks are runner.run.Callback's)."""
