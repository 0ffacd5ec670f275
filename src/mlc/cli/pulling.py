"""A pull as the commands show it: `models pull`, and `--pull` on serve, generate, chat, bench, train and plan.
A download bar (bytes, speed, time left) on stderr, and, before a hub download's weights start, one line of `plan`
for this machine, read from the model's config.json (the store has already checked the free disk by then)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from mlc.errors import MlcError

err = Console(stderr=True)
PLAN_SEQ_LEN = 4096  # the length the line before a download plans for


def run_pull(name: str, include: tuple[str, ...] = (), source: str | None = None, force: bool = False,
             quiet: bool = False):
    """`mlc.models.store.pull` with the bar and the plan line (neither with `quiet`); its PullResult."""
    from mlc.cli.progress import bytes_bar
    from mlc.models.store.pulling import pull

    with bytes_bar(quiet) as bar, hub_log_above(bar.console, quiet):
        task = bar.add_task(f"pulling {name}", total=None)

        def download_progress(done: int, total: int, file: str) -> None:
            bar.update(task, completed=done, total=total, description=file or f"pulling {name}")

        def before_download(pending) -> None:
            line = plan_line(pending)
            if line:
                bar.console.print(line, highlight=False, markup=False, soft_wrap=True)

        return pull(name, force=force, include=include, source=source, download_progress=download_progress,
                    before_download=None if quiet else before_download)


@contextmanager
def hub_log_above(console: Console, quiet: bool = False) -> Iterator[None]:
    """huggingface_hub's warnings (a dropped connection it resumes) as one line each above the bar, not through the
    middle of it; none with `quiet`."""
    logger = logging.getLogger("huggingface_hub")
    handler = logging.NullHandler() if quiet else _ConsoleHandler(console)
    handler.setLevel(logging.WARNING)
    kept, logger.handlers = logger.handlers, [handler]
    try:
        yield
    finally:
        logger.handlers = kept


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        text = " ".join(record.getMessage().split())
        self.console.print(f"note: {text}", highlight=False, markup=False, soft_wrap=True)


def result_line(result) -> str:
    if not result.converted:
        return f"{result.name}: already in the store at {result.path}" + (f" ({result.detail})" if result.detail
                                                                          else "")
    what = f"pulled {result.detail}" if result.detail else "converted"
    return f"{result.name}: {what} in {result.seconds:.1f} s at {result.path}"


def plan_line(pending) -> str | None:
    """`plan` for this machine in one line, from the config.json a hub pull fetched first; None without one."""
    if pending.config is None:
        return None
    from mlc.cluster.presets import detect_hardware
    from mlc.config.hardware import load_profile
    from mlc.plan.model_facts import inspect_model
    from mlc.plan.planner import PlanRequest, plan

    try:
        facts = inspect_model(str(pending.config))
        hw = detect_hardware()
        seq_len = min(PLAN_SEQ_LEN, facts.max_context)
        result = plan(facts, load_profile(hw.profile, measure=True), PlanRequest(seq_len=seq_len, batch=1))
    except MlcError as e:
        return f"plan: {e.message} (pulling anyway)"
    what = f"plan: {pending.spec} ({facts.model_type}, {facts.total_params / 1e9:.2f}B parameters, " \
           f"{pending.total_bytes / 2**30:.2f} GiB to pull)"
    rec = result.recommendation
    if rec is not None and rec.fits and rec.devices <= hw.count:
        return (f"{what} fits {hw.description} with {rec.weight_dtype} weights ({rec.weight_bytes / 2**30:.2f} "
                f"GiB), up to {rec.max_batch} sequences of {seq_len} tokens")
    return (f"{what} does not fit {hw.description}: {result.reason}; downloading anyway (`mlc-cli plan -m "
            f"{pending.spec} --hardware PROFILE` plans it elsewhere)")


def pull_if_asked(model: str | None, pull: bool) -> None:
    """`--pull`: a hub id that is not on this machine is pulled now, and a line says so. Without `--pull` nothing is
    fetched: resolving the model then says to run `mlc-cli models pull` or to pass --pull."""
    if not pull or not model or Path(model).expanduser().exists():
        return
    from mlc.models.store.resolve import hub_spec, local_hub_model

    spec = hub_spec(model)
    if spec is None or local_hub_model(spec) is not None:
        return
    err.print(f"{model} is not on this machine: pulling it first (--pull)", highlight=False, soft_wrap=True)
    err.print(result_line(run_pull(model)), highlight=False, soft_wrap=True)
