"""`mlc-cli deploy --cluster-config cluster.yaml [--model M] [--lora NAME=DIR]`: the server as Ray Serve replicas
behind one endpoint (run it again to roll them onto a new model or adapter); `deploy status`, `deploy down`, and
`deploy nodes` (the `ray start` line of every node)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from mlc.errors import ConfigError

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
deploy_app = typer.Typer(help="Serve on a Ray cluster: replicas behind one endpoint, with separate inference and "
                              "training pools.", invoke_without_command=True, no_args_is_help=False)

STEP_DELAY_ENV = "MLC_TEST_TRAIN_STEP_DELAY_S"  # testing aid: slow each step down to kill a worker mid-run
ClusterOpt = Annotated[Optional[Path], typer.Option(
    "--cluster-config", help="The cluster YAML (`mlc-cli config init cluster`).")]


def load_cluster(path: Path | None, ctx: typer.Context | None = None):
    from mlc.config.cluster_config import ClusterConfig
    from mlc.config.loader import load_config

    if path is None and ctx is not None:
        path = (ctx.obj or {}).get("cluster_config")  # given before the subcommand: deploy --cluster-config X status
    if path is None:
        raise ConfigError("pass --cluster-config cluster.yaml (write one with `mlc-cli config init cluster`)")
    return Path(path), load_config(path, ClusterConfig)


def _serve_config(path: Path, cluster, model: str | None, loras: dict[str, str], api_keys: list[str]):
    from mlc.cluster.service import resolve_paths
    from mlc.config.loader import load_config, read_yaml
    from mlc.config.serve_config import ServeConfig
    from mlc.server.auth import keys_from_env

    serve_path = None
    if cluster.serve_config:
        serve_path = Path(cluster.serve_config).expanduser()
        serve_path = serve_path if serve_path.is_absolute() else path.parent / serve_path
    base = read_yaml(serve_path) if serve_path is not None else {}
    engine = base.get("engine")
    if not isinstance(engine, dict):
        engine = {}
    overrides: dict = {"engine.model": model or cluster.model}
    if loras:
        overrides["engine.lora_adapters"] = {**(engine.get("lora_adapters") or {}), **loras}
    keys = list(dict.fromkeys([*(base.get("api_keys") or []), *api_keys, *keys_from_env()]))
    if keys:
        overrides["api_keys"] = keys
    cfg = load_config(serve_path, ServeConfig, overrides)
    return resolve_paths(cfg, Path.cwd())


@deploy_app.callback()
def deploy(
    ctx: typer.Context,
    cluster_config: ClusterOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model to serve (default: the file's).")] = None,
    lora: Annotated[Optional[list[str]], typer.Option(
        "--lora",
        help="NAME=DIR: also serve this PEFT adapter (repeatable); requests pick it with model=NAME.")] = None,
    api_key: Annotated[Optional[list[str]], typer.Option(
        "--api-key", help="Accepted bearer key (repeatable); MLC_API_KEY may hold more, comma-separated.")] = None,
) -> None:
    """Start the replicas and the endpoint, or roll running replicas onto a new model or adapter one at a time."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"cluster_config": cluster_config}
        return
    from mlc.cli.serve import parse_loras
    from mlc.cluster.ray_runtime import require_ray
    from mlc.cluster.service import deploy as run_deploy
    from mlc.server.observability.hooks import load_hooks

    path, cluster = load_cluster(cluster_config)
    serve_cfg = _serve_config(path, cluster, model, parse_loras(lora), list(api_key or []))
    require_ray("mlc-cli deploy")
    hooks = load_hooks().model_dump(mode="json")
    result = run_deploy(cluster, serve_cfg, hooks, progress=lambda m: err.print(f"  {m}", highlight=False))
    verb = "rolled" if result.rolled else "deployed"
    console.print(f"{verb} {result.replicas} replica(s) of [bold]{result.model}[/]"
                  + (f" with adapter(s) {', '.join(result.adapters)}" if result.adapters else "")
                  + f" (generation {result.generation}) in {result.seconds_to_healthy:.1f}s", highlight=False)
    console.print(f"endpoint: {result.endpoint} (the `mlc-cli serve` API: /health, /generate, /v1/..., /metrics)",
                  highlight=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    if not serve_cfg.api_keys and cluster.host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]warning:[/] the endpoint listens on {cluster.host} without --api-key: anyone who can "
                  "reach it can use the model", highlight=False)


@deploy_app.command("status")
def status_cmd(ctx: typer.Context, cluster_config: ClusterOpt = None,
               as_json: bool = typer.Option(False, "--json", help="Print the status as JSON.")) -> None:
    """The replicas: health, load, model and adapters; and Ray Serve's view of the deployment."""
    from mlc.cluster.ray_runtime import require_ray
    from mlc.cluster.status import status

    _, cluster = load_cluster(cluster_config, ctx)
    require_ray("mlc-cli deploy status")
    report = status(cluster)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    deployed = report["deployed"]
    console.print(f"endpoint {report['endpoint']} on Ray at {report['ray_address']}", highlight=False)
    if deployed:
        console.print(f"deployed: {deployed['model']}, {deployed['replicas']} replica(s), adapters "
                      f"{', '.join(deployed['adapters']) or 'none'} (generation {deployed['generation']})",
                      highlight=False)
    for name, app in report["applications"].items():
        console.print(f"Serve app {name}: {app['status']}" + (f" ({app['message']})" if app["message"] else ""),
                      highlight=False)
    table = Table("replica", "role", "node", "pid", "health", "in flight", "running", "waiting", "KV used", "model",
                  "generation")
    for r in report["replicas"]:
        table.add_row(r["id"], r["role"], r["node"], str(r["pid"]), r["health"], str(r["in_flight"]), str(r["running"]),
                      str(r["waiting"]), f"{r['kv_cache_usage']:.0%}", r["model"] + (
                          f" +{','.join(r['adapters'])}" if r["adapters"] else ""), str(r["generation"]))
    console.print(table if report["replicas"] else "no replica is running")
    if set(report["pools"]) & {"prefill", "decode"}:
        console.print("queued or running by pool: " + ", ".join(f"{p} {n}" for p, n in sorted(report["pools"].items())),
                      highlight=False)
    for r in report["replicas"]:
        if r["stages"]:  # a pipeline-parallel replica: stage 0 is the replica itself
            where = "; ".join(f"stage {s['stage']} rank {s['rank']} on {s['node']} (node {s['node_id'][:8]}, pid "
                              f"{s['pid']})" for s in r["stages"])
            console.print(f"replica {r['id']}: stage 0 on {r['node']} (node {r['node_id'][:8]}); {where}",
                          highlight=False)


@deploy_app.command("down")
def down_cmd(ctx: typer.Context, cluster_config: ClusterOpt = None) -> None:
    """Stop the replicas and the endpoint (and the Ray head `deploy` started here for `ray_address: local`)."""
    from mlc.cluster.ray_runtime import require_ray
    from mlc.cluster.service import down

    _, cluster = load_cluster(cluster_config, ctx)
    require_ray("mlc-cli deploy down")
    for line in down(cluster):
        console.print(line, highlight=False)


@deploy_app.command("nodes")
def nodes_cmd(ctx: typer.Context, cluster_config: ClusterOpt = None) -> None:
    """The `ray start` line to run on each node (a `docker run` of the file's `image` when it names one), which gives
    Ray the pools of the cluster config."""
    from mlc.cluster.ray_runtime import parse_address
    from mlc.cluster.resources import DEFAULT_RAY_PORT, device_kind, raylets

    path, cluster = load_cluster(cluster_config, ctx)
    kind = device_kind(cluster)
    address = parse_address(cluster)
    head = cluster.nodes[0].host
    port = address.local_port or DEFAULT_RAY_PORT
    if not address.is_local and address.text.count(":") == 1:
        port = int(address.text.rpartition(":")[2])
    if cluster.image:  # each raylet in the image (docker/): its replicas and training workers run there
        from mlc.cluster.container import docker_run, store_note

        console.print(f"each node runs Ray in {cluster.image_ref} (built from docker/ with "
                      "--build-arg MLC_EXTRAS=serve,cluster,train)", highlight=False)
        for r in raylets(cluster, kind):
            line = docker_run(r, cluster, kind, f"{head}:{port}", port, path.parent)
            console.print(f"[bold]{r.host}[/]: {line}", highlight=False)
        if note := store_note(cluster):
            console.print(f"note: {note}", highlight=False)
    else:
        for r in raylets(cluster, kind):
            console.print(f"[bold]{r.host}[/]: {r.command(kind, f'{head}:{port}', port)}", highlight=False)
    console.print(f"then, from any machine that reaches {head}: mlc-cli deploy --cluster-config FILE "
                  f"(ray_address: {head}:{port})", highlight=False)


def train_on_cluster_cmd(cluster_path: Path, config: Path | None, args: list[str], cfg, resume: bool,
                         fresh: bool) -> None:
    """`mlc-cli train --cluster-config`: the LoRA run on the training pool; prints the command that rolls the
    adapter onto the serving replicas."""
    import os

    from mlc.cluster.train import roll_command, train_on_cluster
    from mlc.config.loader import load_train_config

    path, cluster = load_cluster(cluster_path)
    if config is None and cluster.training.config:
        train_path = Path(cluster.training.config).expanduser()
        cfg = load_train_config(train_path if train_path.is_absolute() else path.parent / train_path, args)
    step_delay_s = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
    result = train_on_cluster(cluster, cfg, resume=resume, fresh=fresh, step_delay_s=step_delay_s,
                              progress=lambda m: err.print(f"  {m}", highlight=False))
    restarts = result.attempts - 1
    loss = "-" if result.train_loss is None else f"{result.train_loss:.4f}"
    console.print(f"trained {result.steps} step(s) on {result.workers} worker(s) in {result.seconds:.1f}s, last loss "
                  f"{loss}" + (f", resumed after {restarts} worker failure(s)" if restarts else ""), highlight=False)
    console.print(f"adapter: {result.adapter_dir}", highlight=False)
    name = Path(result.output_dir).name.replace("_", "-")
    roll = roll_command(str(path), name, result.adapter_dir, cfg.model, cluster.model)
    console.print(f"roll it onto the replicas: {roll}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(deploy_app, name="deploy")
