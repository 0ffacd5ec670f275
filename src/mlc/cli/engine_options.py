"""The engine's options, defined once from `EngineConfig` and attached to every command that runs the engine.

    @app.command()
    @engine_options()
    def generate(prompt: ..., *, engine: EngineArgs) -> None:
        llm = LLM(config=engine.resolve())

`@engine_options()` adds one typer option per scalar `EngineConfig` field (its type; `None` as the default, so a
flag not given leaves the config file's key, and EngineConfig's default shows in --help) plus `--config FILE` and
`--pull` (a hub id not on this machine is pulled first; not a config key: pulling is the command's act, not the
engine's), all in the "Engine" help panel, and hands the command one `EngineArgs`. The spellings and help texts
are the table `FLAGS`; a field added to EngineConfig without a row still gets `--its-name` (the unit test asks for
a row). Nested fields (`sparse_kv`, `lora_adapters`) are config-file keys; `serve --lora NAME=DIR` sets the adapters;
`speculative_config` is both, its flag taking JSON text as vLLM's does.

Where a command already has an option of the same name or spelling (`generate --seed` is the sampling seed of
each prompt), the command's own option keeps it and the engine's takes what is left (`--engine-seed`).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer

from mlc.config.engine_config import EngineConfig

PANEL = "Engine"


@dataclass(frozen=True)
class Flag:
    decls: tuple[str, ...]  # spellings, first the main one; a bool's "--on/--off" pairs
    help: str
    type: type | None = None  # the command-line type, where it is not the field's (sizes are "4GiB" strings)
    show_default: bool = True  # append EngineConfig's default to the help


# Field -> spellings and help. Keep every spelling: other tools' habits (vLLM's, plan's) and tests pin them.
FLAGS: dict[str, Flag] = {
    "model": Flag(("--model", "-m"), "Store name, HF checkpoint dir, .gguf file, or hub id (org/name[@rev][:QUANT], "
                  "modelscope:org/name, a GLM short name) pulled into the store or in the local HF cache."),
    "device": Flag(("--device",), "cpu, cuda, cuda:N, npu or auto."),
    "dtype": Flag(("--dtype",), "Compute dtype: auto (fp32 on CPU), fp32, fp16, bf16."),
    "weight_dtype": Flag(("--weight-dtype",), "auto, fp32, fp16, bf16 (storage), int8 (W8A8/W8A16 mixed), int4 "
                         "(W4A16, groups of 32); auto keeps the checkpoint's (a GGUF's own bit width)."),
    "kv_cache_dtype": Flag(("--kv-cache-dtype", "--kv-dtype"), "KV cache dtype: {choices}."),
    "kv_cache_memory": Flag(("--kv-cache-memory",), "KV cache budget, e.g. 512MiB or 4GiB (default: "
                            "--kv-cache-fraction of the memory free after the weights load).", type=str),
    "kv_cache_fraction": Flag(("--kv-cache-fraction",), "Share of the memory free after the weights load that the "
                              "KV cache takes, when --kv-cache-memory is not given (vLLM's "
                              "--gpu-memory-utilization reads as this)."),
    "page_size": Flag(("--page-size", "--block-size"), "Tokens per KV page."),
    "max_batch_size": Flag(("--max-batch-size", "--batch", "--max-num-seqs"),
                           "Max running sequences (default: sized from the KV budget, at most 256)."),
    "max_seq_len": Flag(("--max-seq-len", "--seq-len", "--max-model-len"),
                        "Max prompt + output tokens per sequence (default: the model's context length)."),
    "max_num_batched_tokens": Flag(("--max-num-batched-tokens",), "Token budget per engine step."),
    "enable_prefix_caching": Flag(("--prefix-caching/--no-prefix-caching",
                                   "--enable-prefix-caching/--no-enable-prefix-caching"),
                                  "Reuse the KV pages of a shared prompt prefix."),
    "kv_lease_timeout": Flag(("--kv-lease-timeout",), "Prefill/decode split: seconds a prefill instance keeps a "
                             "request's KV pages for its decoder to pull (then frees them; the decoder recomputes)."),
    "enable_chunked_prefill": Flag(("--chunked-prefill/--no-chunked-prefill",
                                    "--enable-chunked-prefill/--no-enable-chunked-prefill"),
                                   "Split long prompts into steps so that decodes keep flowing."),
    "seed": Flag(("--seed",), "Engine seed for the sampling of requests that give no seed."),
    "num_threads": Flag(("--threads", "--num-threads"), "CPU compute threads (default: one per core)."),
    "tensor_parallel_size": Flag(("--tensor-parallel-size", "--tp"), "Split the model over N ranks, one process "
                                 "each (gloo on CPU, nccl on CUDA, hccl on Ascend)."),
    "enable_expert_parallel": Flag(("--enable-expert-parallel",), "MoE models: spread whole experts over the "
                                   "tensor-parallel ranks instead of splitting every expert."),
    "pipeline_parallel_size": Flag(("--pipeline-parallel-size", "--pp"), "Split the model's layers into N stages, "
                                   "one process each, hidden states sent stage to stage (gloo on CPU)."),
    "pipeline_depth": Flag(("--pipeline-depth",), "Micro-batches in flight under pipeline parallelism "
                           "(default: one per stage; 1 lets the stages wait for each other)."),
    "compile": Flag(("--compile/--no-compile",), "Run the forward pass as one torch.compile graph (Llama and GLM-4 "
                    "dense, one rank, no LoRA; needs a C++ compiler): faster small batches after a one-time "
                    "compile."),
    "speculative_config": Flag(("--speculative-config",), "Speculative decoding as JSON, vLLM's keys, e.g. "
                               "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}' (prompt lookup; "
                               "also prompt_lookup_min/max, disable_by_batch_size), '{\"method\": \"mtp\"}' (a "
                               "GLM-4.5/GLM-5 checkpoint's own MTP layer) or '{\"method\": \"draft_model\", "
                               "\"model\": DIR}'. Output unchanged.", type=str,
                               show_default=False),
    "max_loras": Flag(("--max-loras",), "Most distinct LoRA adapters in one batch; a request whose adapter would "
                      "pass it waits for a place (default: no bound)."),
    "max_cpu_loras": Flag(("--max-cpu-loras",), "Most LoRA adapters held loaded; loading one more evicts the least "
                          "recently used one that is not pinned or in use (default: no bound)."),
    "max_lora_rank": Flag(("--max-lora-rank",), "Adapters of a higher rank are refused."),
    "verify": Flag(("--verify",), "Check every byte of a store model against its manifest before loading "
                   "(default: sizes and sampled hashes).", show_default=False),
}
CONFIG_HELP = "Serve config YAML whose engine: keys are read; flags override it."
PULL_HELP = ("Pull the model first when it is a hub id (ORG/NAME[@REVISION][:QUANT], modelscope:..., a GLM short "
             "name) that is not on this machine; without it such a model is never downloaded.")


def _scalar(annotation: Any) -> tuple[type, tuple] | None:
    """(command-line type, Literal choices) of a field's annotation; None for nested or collection fields."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            return None
        annotation = args[0]
    if typing.get_origin(annotation) is Literal:
        return str, typing.get_args(annotation)
    return (annotation, ()) if annotation in (str, int, float, bool) else None


def flag_for(name: str) -> Flag | None:
    """The option of EngineConfig field `name`: its table row, or one derived from the field; None if nested."""
    kind = _scalar(EngineConfig.model_fields[name].annotation)
    row = FLAGS.get(name)
    if kind is None:
        return row if row is not None and row.type is not None else None  # a nested field given as JSON text
    if row is None:
        dashed = name.replace("_", "-")
        row = Flag((f"--{dashed}/--no-{dashed}" if kind[0] is bool else f"--{dashed}",), "")
    return row


def option_fields() -> list[str]:
    """The EngineConfig fields that are command-line options, in the table's order, then any others."""
    names = [*FLAGS, *(n for n in EngineConfig.model_fields if n not in FLAGS)]
    return [n for n in names if n in EngineConfig.model_fields and flag_for(n) is not None]


def _row(name: str) -> Flag:
    """flag_for(name), for a field that is a command-line option (one of option_fields())."""
    row = flag_for(name)
    if row is None:
        raise ValueError(f"EngineConfig.{name} is not a command-line option")
    return row


def _kind(name: str) -> tuple[type, tuple]:
    """_scalar of a field that is a command-line option (one of option_fields())."""
    kind = _scalar(EngineConfig.model_fields[name].annotation)
    if kind is None:
        row = flag_for(name)
        if row is None or row.type is None:
            raise ValueError(f"EngineConfig.{name} is not a command-line option")
        return row.type, ()
    return kind


def _help(name: str, row: Flag) -> str:
    info = EngineConfig.model_fields[name]
    choices = _kind(name)[1]
    text = row.help.replace("{choices}", ", ".join(choices))
    default = info.default
    if row.show_default and default is not None:
        shown = ("on" if default else "off") if isinstance(default, bool) else default
        text = f"{text} Default: {shown}.".strip()
    return text


def option(name: str, decls: tuple[str, ...] | None = None, panel: str | None = None) -> Any:
    """The `typer.Option(...)` of EngineConfig field `name`, for a command that takes a few engine settings of its
    own rather than all of them: `model: Annotated[Optional[str], option("model")] = ...` (`bench quant`)."""
    row = _row(name)
    return typer.Option(*(decls or row.decls), help=_help(name, row), rich_help_panel=panel, show_default=False)


def _annotation(name: str, decls: tuple[str, ...], panel: str) -> Any:
    """`Annotated[Optional[T], option(...)]`: the parameter @engine_options adds for field `name`."""
    kind = _row(name).type or _kind(name)[0]
    return Annotated[Optional[kind], option(name, decls, panel)]


@dataclass
class EngineArgs:
    """What a command got of the engine options: the `--config` file and each field's flag (None: not given)."""

    config: Path | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    pull: bool = False

    def overrides(self) -> dict[str, Any]:
        """The flags as serve config keys (`engine.device`); None still means "not given"."""
        return {f"engine.{name}": value for name, value in self.flags.items()}

    def load(self, notes: list[str] | None = None) -> EngineConfig:
        """The `engine:` section of the config file (or its flat engine keys), then the flags given; with `--pull`,
        a hub id not on this machine is pulled."""
        from mlc.cli.pulling import pull_if_asked
        from mlc.config.loader import load_config
        from mlc.config.serve_config import ServeConfig

        cfg = load_config(self.config, ServeConfig, self.overrides(), notes=notes).engine
        pull_if_asked(cfg.model, self.pull)
        return cfg

    def resolve(self) -> EngineConfig:
        """`load()`, then the tutorial's ASCEND_MAX_MEM; prints a note for each key, flag or variable translated
        and, with --verify, checks every byte of a store model before anything loads."""
        from mlc.cli import common

        notes: list[str] = []
        cfg = self.load(notes)
        common.print_notes(notes + common.ascend_notes(cfg))
        if cfg.verify:
            common.verify_model(cfg.model, full=True)
        return cfg


def config_argv(cfg: EngineConfig, skip: tuple[str, ...] = ("model",)) -> list[str]:
    """`cfg`'s settings that differ from EngineConfig's defaults, as `serve` flags (what `bench compare` passes
    to its server); `engine.sparse_kv` has no flag and is refused."""
    from mlc.errors import ConfigError

    default = EngineConfig()
    argv: list[str] = []
    for name in option_fields():
        value = getattr(cfg, name)
        if name in skip or value == getattr(default, name):
            continue
        on, _, off = _row(name).decls[0].partition("/")
        if isinstance(value, bool):
            if not value and not off:
                raise ConfigError(f"engine.{name}: false has no flag")
            argv.append(on if value else off)
        else:
            argv += [on, value.model_dump_json() if hasattr(value, "model_dump_json") else str(value)]
    for adapter, path in cfg.lora_adapters.items():
        argv += ["--lora", f"{adapter}={path}"]
    if cfg.sparse_kv is not None:
        raise ConfigError("engine.sparse_kv has no serve flag; pass the file itself with --ours-arg=--config "
                          "--ours-arg=FILE")
    return argv


def _spellings(param: inspect.Parameter) -> set[str]:
    """The option strings a command's own parameter takes (`--seed` for `seed: int = None`)."""
    info = next((m for m in getattr(param.annotation, "__metadata__", ()) if isinstance(m, typer.models.ParameterInfo)),
                param.default if isinstance(param.default, typer.models.ParameterInfo) else None)
    if isinstance(info, typer.models.ArgumentInfo):
        return set()
    decls = [*(getattr(info, "param_decls", None) or ())]
    if info is not None and isinstance(info.default, str) and info.default.startswith("-"):
        decls.append(info.default)  # Annotated style: the first spelling arrives as `default`
    decls = decls or [f"--{param.name.replace('_', '-')}"]
    return {s for d in decls for s in d.split("/") if s.startswith("-")}


def engine_options(exclude: tuple[str, ...] = (), config_help: str = CONFIG_HELP):
    """Decorator: add every engine option and `--config` to a typer command whose function takes a keyword-only
    `engine: EngineArgs`; `exclude` names fields the command sets itself (`bench tp` sweeps the TP size)."""

    def decorate(func):
        sig = inspect.signature(func, eval_str=True)
        if "engine" not in sig.parameters or "config" in sig.parameters or "pull" in sig.parameters:
            raise TypeError(f"{func.__name__}: @engine_options needs an `engine` parameter and adds `config`, `pull`")
        own = [p for name, p in sig.parameters.items() if name != "engine"]
        taken_names = {p.name for p in own}
        taken = set().union(*map(_spellings, own)) if own else set()
        names: dict[str, str] = {}  # field -> its parameter's name
        added: list[inspect.Parameter] = []
        for name in option_fields():
            if name in exclude:
                continue
            row = _row(name)
            decls = tuple(d for d in row.decls if not taken & set(d.split("/")))
            if not decls:
                dashed = f"engine-{name.replace('_', '-')}"
                decls = (f"--{dashed}/--no-{dashed}" if "/" in row.decls[0] else f"--{dashed}",)
            names[name] = f"engine_{name}" if name in taken_names else name
            added.append(inspect.Parameter(names[name], inspect.Parameter.KEYWORD_ONLY, default=None,
                                           annotation=_annotation(name, decls, PANEL)))
        added.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            Optional[Path], typer.Option("--config", help=config_help, rich_help_panel=PANEL)]))
        added.append(inspect.Parameter("pull", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
            bool, typer.Option("--pull", help=PULL_HELP, rich_help_panel=PANEL)]))

        @functools.wraps(func)
        def command(*args, **kwargs):
            engine = EngineArgs(kwargs.pop("config"), {name: kwargs.pop(param) for name, param in names.items()},
                                kwargs.pop("pull"))
            return func(*args, **kwargs, engine=engine)

        params = [*own, *added]
        wrapped: Any = command  # a function takes attributes; functools' wrapper type has no room for them
        wrapped.__signature__ = sig.replace(parameters=params)
        wrapped.__annotations__ = {p.name: p.annotation for p in params}
        wrapped.engine_option_names = dict(names)  # field -> parameter, for tests and introspection
        return command

    return decorate
