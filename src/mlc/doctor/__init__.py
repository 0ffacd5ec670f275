"""`mlc-cli doctor`: checks of the host, the model store, a port, a config, a prompt file and a training log, each
a `check.Check` with what to do when it fails (`run.run_doctor` runs the ones asked for)."""
