"""`mlc-cli serve`: the HTTP server (native /generate and the OpenAI-compatible /v1 API) on one model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from mlc.cli import common
from mlc.cli.engine_options import EngineArgs, engine_options
from mlc.errors import ConfigError

err = Console(stderr=True)


def parse_profiles(items: list[str] | None) -> dict[str, int]:
    """`--context-profile qa=4096` (repeatable) -> {"qa": 4096}."""
    out: dict[str, int] = {}
    for item in items or []:
        name, sep, tokens = item.partition("=")
        if not sep or not name.strip() or not tokens.strip().isdigit():
            raise ConfigError(f"--context-profile {item!r} is not NAME=TOKENS; write e.g. --context-profile qa=4096")
        out[name.strip()] = int(tokens)
    return out


def parse_loras(items: list[str] | None) -> dict[str, str]:
    """`--lora support=runs/cs/adapter` (repeatable) -> {"support": "runs/cs/adapter"}."""
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora {item!r} is not NAME=DIR; write e.g. --lora support=runs/cs/adapter")
        out[name.strip()] = path.strip()
    return out


def build_config(config: Path | None, overrides: dict[str, Any], api_keys: list[str], profiles: dict[str, int],
                 notes: list[str] | None = None):
    """ServeConfig from the file, then flags, then ASCEND_MAX_MEM; keys and profiles add to the file's (flags win on
    a name). `notes` gets a line per key, flag or variable translated from another tool's spelling."""
    from mlc.config.loader import load_config, read_yaml
    from mlc.config.serve_config import ServeConfig
    from mlc.server.auth import keys_from_env

    base = read_yaml(config) if config is not None else {}
    keys = list(dict.fromkeys([*(base.get("api_keys") or []), *api_keys, *keys_from_env()]))
    if keys:
        overrides["api_keys"] = keys
    if profiles:
        overrides["context_profiles"] = {**(base.get("context_profiles") or {}), **profiles}
    notes = notes if notes is not None else []
    cfg = load_config(config, ServeConfig, overrides, notes=notes)
    notes += common.ascend_notes(cfg.engine)
    return cfg


def pick_model(positional: str | None, flag: str | None) -> str | None:
    """`mlc-cli serve MODEL` (vLLM's habit) or `--model MODEL`; both is fine when they agree."""
    if positional and flag and positional != flag:
        raise ConfigError(f"the model is given twice ({positional!r} and --model {flag!r}); give it once")
    return positional or flag


def check_model(model: str, verify: bool = False) -> None:
    """Fail before binding the port when the model is not there or differs from its store manifest (a .gguf is
    converted later, in the background, where the engine's load runs the cheap check)."""
    if not model.endswith(".gguf"):
        common.verify_model(model, full=verify)


def register(app: typer.Typer) -> None:
    @app.command()
    @engine_options(config_help="Serve config YAML (engine: keys and the server's); flags override it.")
    def serve(
        model_arg: Annotated[Optional[str], typer.Argument(
            metavar="MODEL", help="Store name, HF checkpoint dir, .gguf file, or hub id (org/name[@rev][:QUANT], a "
            "GLM short name) in the store or the HF cache; --pull fetches one that is not (same as --model).",
            show_default=False)] = None,
        host: Annotated[Optional[str], typer.Option(help="Address to listen on (default 127.0.0.1).")] = None,
        port: Annotated[Optional[int], typer.Option(help="Port (default 8080).")] = None,
        api_key: Annotated[Optional[list[str]], typer.Option(
            "--api-key", help="Accepted bearer key (repeatable); MLC_API_KEY may hold more, comma-separated.")] = None,
        api_key_file: Annotated[Optional[Path], typer.Option(
            help="YAML/JSON file of named keys (SHA-256 hashes) with per-key limits; SIGHUP reloads it.")] = None,
        max_queue: Annotated[Optional[int], typer.Option(
            help="Waiting requests beyond the batch; more get 429.")] = None,
        request_timeout: Annotated[Optional[float], typer.Option(
            help="Seconds per request; past it the request ends with finish_reason 'timeout'.")] = None,
        shutdown_grace: Annotated[Optional[float], typer.Option(
            help="On SIGTERM, seconds in-flight requests get before being cancelled.")] = None,
        audit_log: Annotated[Optional[Path], typer.Option(help="Write one JSON line per request here.")] = None,
        audit_log_content: Annotated[Optional[bool], typer.Option(
            "--audit-log-content", help="Also log prompts and outputs (off: counts only).")] = None,
        strict_input: Annotated[Optional[bool], typer.Option(
            "--strict-input", help="Reject prompts with invisible format characters; default: strip them.")] = None,
        context_profile: Annotated[Optional[list[str]], typer.Option(
            "--context-profile", help="NAME=TOKENS, a named context limit requests pick (repeatable).")] = None,
        default_max_tokens: Annotated[Optional[int], typer.Option(
            help="Completion length when a request gives none (default 512).")] = None,
        served_model_name: Annotated[Optional[str], typer.Option(
            help="Model id for clients; default: the model.")] = None,
        tool_call_parser: Annotated[Optional[str], typer.Option(
            help="Tool call format: glm45, glm4, hermes or llama3_json (vLLM's names too); default: read from the "
            "chat template.")] = None,
        api_lenient: Annotated[Optional[bool], typer.Option(
            "--api-lenient", help="Ignore request fields the API does not know (named in the x-mlc-ignored-fields "
            "header and the log) instead of a 400.")] = None,
        max_connections: Annotated[Optional[int], typer.Option(
            help="Open connections at once; past it new requests get 503 (default 1000).")] = None,
        header_timeout: Annotated[Optional[float], typer.Option(
            help="Seconds for a request's line and headers to arrive; a slower client is cut (default 10).")] = None,
        body_timeout: Annotated[Optional[float], typer.Option(
            help="Seconds for a request's body to arrive after its headers (default 60).")] = None,
        keep_alive_timeout: Annotated[Optional[float], typer.Option(
            help="Seconds an idle keep-alive connection stays open (default 5).")] = None,
        kv_role: Annotated[Optional[str], typer.Option(
            "--kv-role", help="Prefill/decode disaggregation: prefill (computes prompts, leases their KV pages), "
            "decode (pulls them and decodes) or both (default: either, for whoever asks).")] = None,
        lora: Annotated[Optional[list[str]], typer.Option(
            "--lora",
            help="NAME=DIR: serve a PEFT LoRA adapter; requests select it with model=NAME (repeatable).")] = None,
        enable_lora_loading: Annotated[Optional[bool], typer.Option(
            "--enable-lora-loading", help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters "
            "from --lora-dir / --allowed-lora-paths only).")] = None,
        lora_dir: Annotated[Optional[list[str]], typer.Option(
            "--lora-dir", help="DIR of adapter directories: a request for model NAME not loaded yet loads DIR/NAME; "
            "the load route may read it (repeatable).")] = None,
        allowed_lora_paths: Annotated[Optional[list[str]], typer.Option(
            "--allowed-lora-paths", help="Another DIR the load route may read adapters from (repeatable).")] = None,
        admin_api_key: Annotated[Optional[list[str]], typer.Option(
            "--admin-api-key", help="Key for the adapter routes (repeatable; or MLC_ADMIN_API_KEY); with --api-key "
            "set, those routes need one of these.")] = None,
        log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
        access_log: Annotated[bool, typer.Option("--access-log/--no-access-log")] = True,
        *,
        engine: EngineArgs,
    ) -> None:
        """Serve a model over HTTP: /generate, /v1/completions, /v1/chat/completions, /metrics, a chat page at /.

        Also takes vLLM's and MindIE's flag names (--gpu-memory-utilization, --device_id, ...; see the README);
        each one translated prints what it became."""
        from mlc.cli.pulling import pull_if_asked
        from mlc.server.observability.hooks import load_hooks
        from mlc.server.run import build_server

        overrides = engine.overrides() | {"engine.model": pick_model(model_arg, engine.flags["model"])}
        overrides |= {
            "host": host, "port": port, "max_queue": max_queue, "request_timeout_s": request_timeout,
            "shutdown_grace_s": shutdown_grace, "audit_log": str(audit_log) if audit_log else None,
            "api_key_file": str(api_key_file) if api_key_file else None,
            "audit_log_content": audit_log_content, "strict_input": strict_input,
            "default_max_tokens": default_max_tokens, "served_model_name": served_model_name,
            "tool_call_parser": tool_call_parser, "api_lenient": api_lenient, "max_connections": max_connections,
            "header_timeout_s": header_timeout, "body_timeout_s": body_timeout,
            "keep_alive_timeout_s": keep_alive_timeout, "kv_role": kv_role,
            "enable_lora_loading": enable_lora_loading, "lora_dirs": lora_dir,
            "allowed_lora_paths": allowed_lora_paths,
        }
        from mlc.server.auth import ADMIN_ENV_VAR, keys_from_env

        admin_keys = [*(admin_api_key or []), *keys_from_env(var=ADMIN_ENV_VAR)]
        if admin_keys:
            overrides["admin_api_keys"] = list(dict.fromkeys(admin_keys))
        if lora:
            overrides["engine.lora_adapters"] = parse_loras(lora)
        notes: list[str] = []
        cfg = build_config(engine.config, overrides, list(api_key or []), parse_profiles(context_profile), notes)
        common.print_notes(notes)
        hooks = load_hooks()
        pull_if_asked(cfg.engine.model, engine.pull)
        check_model(cfg.engine.model, cfg.engine.verify)
        level = log_level.upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"--log-level {log_level!r}: use debug, info, warning or error")
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        server = build_server(cfg, hooks, log_level=log_level.lower(), access_log=access_log)
        ring = server.state.keys
        auth = (f"{len(ring.plain) + len(ring.entries)} API key(s)" if ring.enabled else "no auth") + (
            f", {len(ring.entries)} named from {cfg.api_key_file}" if cfg.api_key_file else "")
        if not ring.enabled and cfg.host not in ("127.0.0.1", "localhost", "::1"):
            err.print(f"[yellow]warning:[/] listening on {cfg.host} without --api-key: anyone who can reach this "
                      "port can use the model", highlight=False)
        hook_note = f", {len(hooks.post_inference)} post_inference hook(s)" if hooks.post_inference else ""
        err.print(f"serving [bold]{cfg.engine.model}[/] on http://{cfg.host}:{cfg.port} ({auth}{hook_note}); "
                  "the model loads in the background, /health answers 200 when it is ready", highlight=False,
                  soft_wrap=True)
        server.run()
        if server.state.exit_code:
            raise typer.Exit(server.state.exit_code)
