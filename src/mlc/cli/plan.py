"""`mlc-cli plan`: memory, fit, largest batch, pages and a recommended layout with its decode roofline."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

console = Console(soft_wrap=True)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _par(lay) -> str:
    pp = f" x PP {lay.pipeline_parallel}" if lay.pipeline_parallel > 1 else ""
    ep = ", EP" if lay.expert_parallel else ""
    return f"{lay.devices} (TP {lay.tensor_parallel}{pp}{ep})"


ROWS = [
    ("weights", lambda lay: lay.weight_dtype),
    ("kv cache", lambda lay: lay.kv_dtype + ("" if lay.kv_bytes_per_token_exact else " (size estimated)")),
    ("sparse kv ratio", lambda lay: f"{lay.sparse_kv_ratio:g}" if lay.sparse_kv_ratio else "off"),
    ("devices", _par),
    ("weights / device", lambda lay: _gib(lay.weight_bytes)),
    ("kv bytes / token / device", lambda lay: f"{lay.kv_bytes_per_token:,}"),
    ("pages (incl. null page)", lambda lay: f"{lay.pages:,} ({lay.pages_per_seq:,} per sequence)"),
    ("kv cache / device", lambda lay: _gib(lay.kv_bytes)),
    ("activations (est.)", lambda lay: _gib(lay.activation_bytes)),
    ("runtime reserve", lambda lay: _gib(lay.reserve_bytes)),
    ("total / usable", lambda lay: f"{_gib(lay.total_bytes)} / {_gib(lay.capacity_bytes)}"),
    ("fits", lambda lay: "[green]yes[/]" if lay.fits else "[red]no[/]"),
    ("largest batch at seq_len", lambda lay: str(lay.max_batch)),
    ("decode tok/s (roofline)",
     lambda lay: f"{lay.decode_tok_s:,.0f} total, {lay.decode_tok_s_per_seq:,.1f} per sequence, {lay.bound}-bound"),
]


def _option_line(lay) -> str:
    sparse = f", sparse KV {lay.sparse_kv_ratio:g}" if lay.sparse_kv_ratio else ""
    return (f"option {lay.tier}: {lay.weight_dtype} weights, {lay.kv_dtype} KV{sparse} on {_par(lay)}: "
            f"{_gib(lay.total_bytes)} per device, largest batch {lay.max_batch}, <= {lay.decode_tok_s:,.0f} tok/s")


def print_plan(result) -> None:
    m, hw, req, lay = result.model, result.hardware, result.request, result.requested
    console.print(
        f"[bold]{m['name']}[/] ({m['model_type']}, {m['total_params'] / 1e9:,.3f}B parameters, "
        f"{m['active_params'] / 1e9:,.3f}B active per token, {m['layers']} layers; {m['source']})", highlight=False)
    console.print(
        f"on [bold]{hw['name']}[/]: {hw['description']}; {_gib(hw['memory_bytes'])} and "
        f"{hw['memory_bandwidth_gbps']:,.0f} GB/s per device; compute in {hw['compute_dtype']}", highlight=False)
    seq = min(req["seq_len"], m["max_context"])
    console.print(f"seq_len {seq:,} x batch {req['batch']}, page_size {req['page_size']}", highlight=False)
    table = Table()
    table.add_column("")
    table.add_column("requested")
    rec = result.recommendation
    if rec is not None:
        table.add_column("recommended")
    for label, cell in ROWS:
        table.add_row(label, cell(lay), *([cell(rec)] if rec is not None else []))
    console.print(table)
    console.print(f"recommendation: {result.reason}", highlight=False)
    for alt in result.alternatives:
        if alt is not rec:
            console.print("  " + _option_line(alt), highlight=False)
    for note in result.notes + lay.notes + (rec.notes if rec is not None and rec is not lay else []):
        console.print(f"  note: {note}", highlight=False)
    if result.command:
        console.print(f"serve it with: {result.command}", highlight=False)


def plan_command(
    model: str = typer.Option(
        None, "--model", "-m",
        help="Store name, checkpoint dir, config.json, a built-in shape (glm-4-9b, glm-4.5, glm-4.5-air, glm-5), or a "
        "hub id on this machine (pulled, or in the HF cache; --pull reads its config.json from the hub)."),
    hardware: str = typer.Option(
        "cpu", "--hardware",
        help="Profile: cpu, nvidia-h200, nvidia-a100-80g, ascend-910b, ascend-310p, or a .yaml."),
    seq_len: int = typer.Option(
        None, "--seq-len", "--max-seq-len", "--max-model-len",
        help="Tokens per sequence (prompt + completion). [default: 32768]"),
    batch: int = typer.Option(
        None, "--batch", "--max-batch-size", "--max-num-seqs", help="Sequences decoded together. [default: 8]"),
    kv_dtype: str = typer.Option(
        None, "--kv-dtype", "--kv-cache-dtype", help="auto | fp32 | fp16 | bf16 | int8 | int4"),
    weight_dtype: str = typer.Option(None, "--weight-dtype", help="auto | fp32 | fp16 | bf16 | int8 | int4"),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype: auto | fp32 | fp16 | bf16"),
    page_size: int = typer.Option(None, "--page-size", "--block-size", help="Tokens per KV page. [default: 16]"),
    devices: int = typer.Option(None, "--devices", help="Devices for the requested layout (TP inside a node)."),
    sparse_kv_ratio: float = typer.Option(
        None, "--sparse-kv-ratio", help="Plan with sparse KV keeping this share of old tokens."),
    config: str = typer.Option(None, "--config", help="A serve.yaml to take engine settings from (flags override it)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    pull: bool = typer.Option(False, "--pull", help="A hub id not on this machine: fetch its config.json from the hub "
                              "(at the commit its revision resolves to) into the HF cache; the weights are not "
                              "downloaded, planning needs none."),
) -> None:
    """Will the model fit, how large a batch, how many pages, which dtypes and devices, how fast."""
    from mlc.config.hardware import load_profile
    from mlc.config.loader import load_config
    from mlc.config.serve_config import ServeConfig
    from mlc.plan.model_facts import inspect_model
    from mlc.plan.planner import PlanRequest, plan

    overrides = {
        "engine.model": model, "engine.kv_cache_dtype": kv_dtype, "engine.weight_dtype": weight_dtype,
        "engine.dtype": dtype, "engine.page_size": page_size, "engine.max_batch_size": batch,
        "engine.max_seq_len": seq_len,
    }
    if sparse_kv_ratio is not None:
        overrides["engine.sparse_kv.ratio"] = sparse_kv_ratio
    engine = load_config(config, ServeConfig, overrides).engine
    request = PlanRequest(
        seq_len=engine.max_seq_len or 32768,
        batch=engine.max_batch_size or 8,  # unset (the engine sizes it from the KV budget): plan for 8
        dtype=engine.dtype, weight_dtype=engine.weight_dtype, kv_dtype=engine.kv_cache_dtype,
        page_size=engine.page_size, devices=devices,
        sparse_kv_ratio=engine.sparse_kv.ratio if engine.sparse_kv else None,
        max_num_batched_tokens=engine.max_num_batched_tokens,
    )
    profile = load_profile(hardware, measure=True)
    if pull:
        fetch_config_if_missing(engine.model)
    result = plan(inspect_model(engine.model), profile, request)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        print_plan(result)


def fetch_config_if_missing(model: str) -> None:
    """`plan --pull`: the config.json of a hub id that is not on this machine, from the hub (a line says so)."""
    from pathlib import Path

    from mlc.models.store.hub import fetch_config
    from mlc.models.store.resolve import hub_config, hub_spec
    from mlc.plan.shapes import SHAPES

    spec = hub_spec(model) if not Path(model).expanduser().exists() and model.lower() not in SHAPES else None
    if spec is None or hub_config(spec) is not None:
        return
    path = fetch_config(spec)
    typer.echo(f"read {spec}'s config.json from the hub into {path.parent} (--pull; no weights downloaded)", err=True)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
