"""`mlc-cli train --cluster-config cluster.yaml`: the LoRA recipe (`LoRATrainer`, unchanged) as a Ray Train job,
`TorchTrainer` with torch DDP under it, on the cluster's training pool only.

Ray starts one worker per `training.workers`, each asking for one unit of the `mlc_training` resource that only
training devices carry, and sets up the process group (gloo on CPU, nccl on CUDA, hccl on Ascend); `LoRATrainer`
finds it through RANK / WORLD_SIZE like under torchrun. Checkpoints go to `output_dir` under `training.storage`,
a directory every training node mounts. When a worker dies, Ray restarts the whole group (`max_failures` times,
`FailureConfig`) and the recipe resumes from its last checkpoint: the same steps, the same loss curve.
"""

from __future__ import annotations

import math
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from mlc.config.cluster_config import ClusterConfig
from mlc.config.train_config import TrainConfig
from mlc.errors import ConfigError, TrainingError

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass
class ClusterTrainResult:
    output_dir: str
    adapter_dir: str
    steps: int
    train_loss: float | None
    workers: int
    attempts: int  # 1 + worker-group restarts after a failure
    seconds: float


def output_dir_for(cluster: ClusterConfig, cfg: TrainConfig) -> Path:
    """A relative output_dir lives under training.storage (shared by every training node); an absolute one stays."""
    out = Path(cfg.output_dir).expanduser()
    return out if out.is_absolute() else Path(cluster.training.storage).expanduser().resolve() / out


def clear_run(out: Path) -> None:
    """`--fresh`, done once here rather than by the workers, which must not redo it after a restart."""
    from mlc.train import checkpoint as ckpt
    from mlc.train.logging import TrainLog
    from mlc.train.trainer import ADAPTER_DIR, SUMMARY_FILE

    for name in (ckpt.CHECKPOINTS, ADAPTER_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (TrainLog(out).path.name, SUMMARY_FILE, "loss.png"):
        (out / name).unlink(missing_ok=True)


def _worker_loop(config: dict) -> None:
    """One Ray Train worker: the recipe on this worker's rank, resuming from the newest checkpoint if any."""
    import os

    import ray.train
    import torch

    from mlc.train.trainer import LoRATrainer, RunOptions

    torch.set_num_threads(config["threads"])
    attempts = Path(config["output_dir"]) / ".ray-attempts"
    if ray.train.get_context().get_world_rank() == 0:
        attempts.mkdir(parents=True, exist_ok=True)
        (attempts / f"{config['run_token']}-{os.getpid()}").touch()

    class RayLoRATrainer(LoRATrainer):
        def save(self, step: int) -> None:
            super().save(step)
            ray.train.report({"step": step})  # progress for Ray; the checkpoint itself is already on storage

        def train_step(self, step: int) -> dict:
            record = super().train_step(step)
            if config["step_delay_s"]:
                time.sleep(config["step_delay_s"])  # testing aid: time to kill a worker mid-run
            return record

    cfg = TrainConfig(**config["train"])
    result = RayLoRATrainer(cfg, RunOptions(resume=config["resume"], progress=False)).run()
    ray.train.report({"step": result.steps, "done": True, "adapter_dir": result.adapter_dir,
                      "train_loss": result.train_loss if result.train_loss is not None else math.nan})


def train_on_cluster(cluster: ClusterConfig, cfg: TrainConfig, resume: bool = False, fresh: bool = False,
                     step_delay_s: float = 0.0, progress=lambda _: None) -> ClusterTrainResult:
    from mlc.cluster import ray_runtime
    from mlc.cluster.resources import device_kind, needed, worker_resources

    ray_runtime.require_ray("mlc-cli train --cluster-config")
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if cluster.pool_size("training") == 0:
        raise ConfigError("no device of the cluster is labelled for training; add a `pools: {training: [...]}` "
                          "section to the cluster config (training and serving never share a device)")
    if resume and fresh:
        raise ConfigError("--resume and --fresh contradict each other; pick one")
    if ":" in cfg.device:
        raise ConfigError(f"device {cfg.device!r}: on a cluster Ray gives each worker its own device; write cpu, "
                          "cuda or npu without an index")
    kind = device_kind(cluster)
    out = output_dir_for(cluster, cfg)
    cfg = cfg.model_copy(update={"output_dir": str(out), "device": kind if cfg.device == "cpu" else cfg.device,
                                 "model": _absolute_if_local(cfg.model),
                                 "data": cfg.data.model_copy(update={"train": _absolute_if_local(cfg.data.train),
                                                                     "eval": _absolute_if_local(cfg.data.eval)})})
    t0 = time.monotonic()
    conn = ray_runtime.connect(cluster, kind)
    try:
        ray_runtime.check_resources(needed(cluster, kind, "training"), f"{cluster.training.workers} training worker(s)")
        if fresh:
            clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex[:12]
        loop_config = {"train": cfg.model_dump(mode="json"), "resume": "always" if resume else "auto",
                       "threads": max(1, int(cluster.training.cpus_per_worker)), "output_dir": str(out),
                       "run_token": token, "step_delay_s": step_delay_s}
        resources = worker_resources(cluster, kind)
        trainer = TorchTrainer(
            _worker_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=cluster.training.workers, use_gpu=kind == "cuda",
                                         resources_per_worker={k: v for k, v in resources.items() if k != "GPU"}),
            torch_config=TorchConfig(backend=BACKENDS[kind]),
            run_config=RunConfig(name=f"{out.name}-{token}", storage_path=str(out / "ray"),
                                 failure_config=FailureConfig(max_failures=cluster.training.max_failures)),
        )
        progress(f"training on {cluster.training.workers} worker(s) of the training pool; checkpoints in {out}")
        try:
            result = trainer.fit()
        except Exception as e:
            raise TrainingError(f"the Ray Train job failed after {cluster.training.max_failures} restart(s): "
                                f"{_root_cause(e)}; its checkpoints in {out} let the next run resume") from None
        error = getattr(result, "error", None)
        if error is not None:
            raise TrainingError(f"the Ray Train job failed: {_root_cause(error)}")
        metrics = result.metrics or {}
    finally:
        ray_runtime.undo(conn)  # disconnect; a head this run started for `local` is stopped with it
    attempts = len(list((out / ".ray-attempts").glob(f"{token}-*")))
    loss = metrics.get("train_loss")
    return ClusterTrainResult(
        output_dir=str(out), adapter_dir=metrics.get("adapter_dir", str(out / "adapter")),
        steps=int(metrics.get("step", 0)), train_loss=None if loss is None or math.isnan(loss) else loss,
        workers=cluster.training.workers, attempts=max(1, attempts), seconds=time.monotonic() - t0)


def _absolute_if_local(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def roll_command(cluster_path: str, name: str, adapter_dir: str, base_model: str, cluster_model: str) -> str:
    """The one command that puts a trained adapter on the serving replicas. The replicas must serve the model it
    was trained on: `--model` is added when that is not the cluster file's model."""
    model = "" if base_model == cluster_model else f" --model {base_model}"
    return f"mlc-cli deploy --cluster-config {cluster_path}{model} --lora {name}={adapter_dir}"

