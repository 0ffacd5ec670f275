"""Other tools' spellings of the training config, rewritten to ours before validation.

- The reference tutorial (MindFormers): `lora_config: {lora_r, lora_alpha, lora_dropout, lora_dtype,
  target_modules}`, `optimizer: {learning_rate, beta1, beta2}`, `parallel_config: {data_parallel, model_parallel,
  pipeline_stage}`.
- LLaMA-Factory / HF TrainingArguments: `model_name_or_path`, `cutoff_len`, `per_device_train_batch_size`,
  `num_train_epochs`, `lora_rank`, `lora_target`, `save_steps`, ... (`LLAMA_FACTORY`), and its run-kind keys
  (`stage: sft|dpo|kto|rm`, `finetuning_type: lora`, `do_train: true`) when they ask for what `mlc-cli train` does.

Each rewrite is recorded (`origin`, or a line in `notes`); a value that asks for something mlc cannot do yet
(pipeline_stage 2, stage ppo) is refused with what to write instead, never dropped.
"""

from __future__ import annotations

import copy
from pathlib import Path

from mlc.config.dotted import move_alias, pop_path

# The tutorial's lora_config.yaml / MindFormers spellings -> our dotted keys.
TUTORIAL: dict[str, str] = {
    **{f"{section}.{src}": f"lora.{dst}" for section in ("lora_config", "lora") for src, dst in (
        ("lora_r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout"), ("lora_dtype", "dtype"),
    )},
    "lora_config.target_modules": "lora.target_modules",
    "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_dtype": "lora.dtype",
    "optimizer.learning_rate": "optimizer.lr",
    "learning_rate": "optimizer.lr",
}
# LLaMA-Factory (and HF TrainingArguments) names -> ours.
LLAMA_FACTORY: dict[str, str] = {
    "model_name_or_path": "model",
    "cutoff_len": "max_seq_len",
    "per_device_train_batch_size": "batch_size",
    "num_train_epochs": "epochs",
    "lora_rank": "lora.r",
    "lora_target": "lora.target_modules",
    "save_steps": "save_every",
    "save_total_limit": "keep_checkpoints",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "weight_decay": "optimizer.weight_decay",
    "adam_epsilon": "optimizer.eps",
    "max_grad_norm": "clip_norm",
    "lr_scheduler_type": "lr_schedule.type",
    "warmup_ratio": "lr_schedule.warmup_ratio",
    "warmup_steps": "lr_schedule.warmup_steps",
    "eval_dataset": "data.eval",
}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Keys that name the kind of run: the value mlc-cli train does, or why another value is refused.
RUN_KIND = {
    "do_train": (True, "mlc-cli train always trains; evaluate with `mlc-cli eval`"),
}
FINETUNING_TYPES = ("lora", "qlora")
SCHEDULER_NAMES = {"constant_with_warmup": "constant"}  # ours warm up first whatever the type
PARALLEL_KEYS = ("data_parallel", "model_parallel", "pipeline_stage")


def normalize_train_aliases(raw: dict, notes: list[str] | None = None,
                            default_betas: tuple[float, float] = (0.9, 0.999)) -> tuple[dict, dict[str, str]]:
    """The tutorial's and LLaMA-Factory's spellings -> ours. Returns the new dict and {our key: key as written}."""
    data = copy.deepcopy(raw)
    origin: dict[str, str] = {}
    notes = notes if notes is not None else []
    lf_alpha = "lora_rank" in data and not any(k in data for k in ("lora_alpha", "lora_config", "lora"))
    for src, dst in {**TUTORIAL, **LLAMA_FACTORY}.items():
        move_alias(data, src, dst, origin)
    if lf_alpha and isinstance(data["lora"].get("r"), int):
        data["lora"]["alpha"] = 2 * data["lora"]["r"]  # LLaMA-Factory's default when only the rank is given
        notes.append(f"lora_rank: {data['lora']['r']} without lora_alpha -> lora.alpha: {data['lora']['alpha']} "
                     "(LLaMA-Factory's default, twice the rank)")
    _betas(data, origin, default_betas)
    _parallel(data, origin, notes)
    _run_kind(data, notes)
    _finetuning(data, notes)
    _precision_flags(data, origin)
    _dataset(data, origin)
    _lora_target(data, notes)
    _scheduler(data, notes)
    return data, origin


def _betas(data: dict, origin: dict[str, str], default: tuple[float, float]) -> None:
    for a, b in (("adam_beta1", "beta1"), ("adam_beta2", "beta2")):
        if a in data:
            data.setdefault("optimizer", {})
            if not isinstance(data["optimizer"], dict) or b in data["optimizer"]:
                raise ValueError(f"{a} and optimizer.{b} both given; keep one of them")
            data["optimizer"][b] = data.pop(a)
    opt = data.get("optimizer")
    if isinstance(opt, dict) and ("beta1" in opt or "beta2" in opt):
        if "betas" in opt:
            raise ValueError("optimizer: give betas or beta1/beta2, not both")
        opt["betas"] = [opt.pop("beta1", default[0]), opt.pop("beta2", default[1])]
        origin["optimizer.betas"] = "optimizer.beta1/beta2"


def _parallel(data: dict, origin: dict[str, str], notes: list[str]) -> None:
    """parallel_config: data_parallel -> nproc (processes), model_parallel -> tensor_parallel; pipeline parallel
    above 1 is refused."""
    found, section = pop_path(data, "parallel_config")
    if not found or section is None:
        return
    if not isinstance(section, dict):
        raise ValueError("parallel_config must be a mapping, e.g. {data_parallel: 2, model_parallel: 1}")
    unknown = sorted(set(section) - set(PARALLEL_KEYS))
    if unknown:
        raise ValueError(f"parallel_config.{unknown[0]}: unknown key (allowed: {', '.join(PARALLEL_KEYS)})")
    sizes = {}
    for key, value in section.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel_config.{key} must be an integer >= 1, got {value!r}")
        sizes[key] = value
    if sizes.get("pipeline_stage", 1) > 1:
        raise ValueError(
            f"parallel_config.pipeline_stage: {sizes['pipeline_stage']}: pipeline parallel training is not available "
            "in mlc yet; set pipeline_stage: 1 and split the model with model_parallel (tensor parallel) and the "
            "data with data_parallel")
    if "pipeline_stage" in sizes:
        notes.append("parallel_config.pipeline_stage: 1 -> nothing to change (no pipeline stages)")
    if "model_parallel" in sizes:
        if "tensor_parallel" in data and data["tensor_parallel"] != sizes["model_parallel"]:
            raise ValueError(f"parallel_config.model_parallel ({sizes['model_parallel']}) and tensor_parallel "
                             f"({data['tensor_parallel']}) disagree; keep one of them")
        data["tensor_parallel"] = sizes["model_parallel"]
        origin["tensor_parallel"] = "parallel_config.model_parallel"
    if "data_parallel" in sizes:
        if "nproc" in data and data["nproc"] != sizes["data_parallel"]:
            raise ValueError(f"parallel_config.data_parallel ({sizes['data_parallel']}) and nproc ({data['nproc']}) "
                             "disagree; keep one of them")
        data["nproc"] = sizes["data_parallel"]
        origin["nproc"] = "parallel_config.data_parallel"


STAGES = ("sft", "dpo", "kto", "rm")


def _run_kind(data: dict, notes: list[str]) -> None:
    if "stage" in data:
        stage = data["stage"].lower() if isinstance(data["stage"], str) else data["stage"]
        if stage not in STAGES:
            raise ValueError(f"stage: {data['stage']!r}: mlc-cli train runs stage sft, dpo (pref_loss sigmoid, ipo, "
                             "orpo or simpo), kto or rm; ppo and pt are not built")
        data["stage"] = stage
    for key, (ours, why) in RUN_KIND.items():
        if key not in data:
            continue
        value = data.pop(key)
        if (value.lower() if isinstance(value, str) else value) != ours:
            raise ValueError(f"{key}: {value!r}: {why}")
        notes.append(f"{key}: {value} -> accepted (what mlc-cli train does)")
    if "template" in data:
        template = data.pop("template")
        notes.append(f"template: {template} -> the chat template in the model's tokenizer_config.json (GLM-4's for a "
                     "GLM checkpoint without one); preprocess and serving use the same one")


def _finetuning(data: dict, notes: list[str]) -> None:
    """`finetuning_type: lora | qlora` (freeze and full are refused: not built); LLaMA-Factory's `quantization_bit: 4`
    on a lora run means qlora."""
    kind = data.get("finetuning_type")
    if isinstance(kind, str):
        kind = data["finetuning_type"] = kind.lower()
    if kind is not None and kind not in FINETUNING_TYPES:
        raise ValueError(f"finetuning_type: {data['finetuning_type']!r}: mlc-cli train trains LoRA adapters on a "
                         "frozen base (lora) or on a base stored 4-bit (qlora); freeze and full tuning are not built "
                         "yet")
    if "quantization_bit" not in data:
        return
    bits = data.pop("quantization_bit")
    if bits is None:
        return
    if bits != 4:
        raise ValueError(f"quantization_bit: {bits!r}: mlc-cli train stores the frozen base 4-bit only "
                         "(quantization_bit: 4, or finetuning_type: qlora)")
    data["finetuning_type"] = "qlora"
    notes.append("quantization_bit: 4 -> finetuning_type: qlora (the base's linear layers stored 4-bit)")


def _precision_flags(data: dict, origin: dict[str, str]) -> None:
    """LLaMA-Factory's `bf16: true` / `fp16: true` -> precision."""
    given = {name: data.pop(name) for name in ("bf16", "fp16") if name in data}
    if not given:
        return
    bad = [f"{name}: {value!r}" for name, value in given.items() if not isinstance(value, bool)]
    if bad:
        raise ValueError(f"{bad[0]}: write true or false")
    chosen = [name for name, on in given.items() if on]
    if len(chosen) > 1:
        raise ValueError("bf16: true and fp16: true both given; keep one (or write precision: bf16|fp16|fp32)")
    precision = chosen[0] if chosen else "fp32"  # both off means full precision, as in LLaMA-Factory
    written = f"{chosen[0]}: true" if chosen else "/".join(f"{name}: false" for name in given)
    if data.get("precision", precision) != precision:
        raise ValueError(f"{written} and precision: {data['precision']} disagree; keep one of them")
    data["precision"] = precision
    origin["precision"] = written


def _dataset(data: dict, origin: dict[str, str]) -> None:
    """`dataset` (+ `dataset_dir`): a file path, or one name in dataset_dir/dataset_info.json -> data.train; an
    `eval_dataset` name is looked up the same way. The entry's formatting, columns and tags are checked here and
    read with the file (mlc.config.dataset_info finds the entry again from the file's path)."""
    eval_name = data["data"].get("eval") if origin.get("data.eval") == "eval_dataset" else None
    if "dataset" not in data:
        if "dataset_dir" in data and not isinstance(eval_name, str):
            raise ValueError("dataset_dir: given without dataset; name the file with dataset (or data.train)")
        folder = Path(str(data.pop("dataset_dir", "data")))
        if isinstance(eval_name, str):
            data["data"]["eval"] = _dataset_file(eval_name, folder, "eval_dataset")
        return
    name = data.pop("dataset")
    folder = Path(str(data.pop("dataset_dir", "data")))
    if not isinstance(name, str) or "," in name:
        raise ValueError(f"dataset: {name!r}: mlc trains on one file; give its path (dataset: data/train.jsonl or "
                         "data.train: ...), merging several datasets into one JSONL first")
    path = _dataset_file(name, folder)
    if "data" in data and isinstance(data["data"], dict) and data["data"].get("train") not in (None, path):
        raise ValueError(f"dataset ({name}) and data.train ({data['data']['train']}) disagree; keep one of them")
    data.setdefault("data", {})
    data["data"]["train"] = path
    origin["data.train"] = "dataset"
    if isinstance(eval_name, str):
        data["data"]["eval"] = _dataset_file(eval_name, folder, "eval_dataset")


def _dataset_file(name: str, folder: Path, key: str = "dataset") -> str:
    from mlc.config.dataset_info import entry_file

    if Path(name).suffix in (".json", ".jsonl") or Path(name).is_file() or Path(name).is_dir():
        return name
    if "," in name:
        raise ValueError(f"{key}: {name!r}: mlc reads one file; merge the datasets into one JSONL first")
    try:
        return entry_file(name, folder)[0]  # a bad formatting, columns or tags is reported now, not mid-run
    except ValueError as e:
        raise ValueError(str(e).replace("dataset: ", f"{key}: ", 1)) from None


def _lora_target(data: dict, notes: list[str]) -> None:
    """LLaMA-Factory's `lora_target: q_proj,v_proj` (a comma string) or `all` (every linear layer)."""
    lora = data.get("lora")
    if not isinstance(lora, dict):
        return
    target = lora.get("target_modules")
    if not isinstance(target, str):
        return
    if target.strip().lower() == "all":
        lora["target_modules"] = list(ALL_LINEAR)
        notes.append(f"lora_target: all -> lora.target_modules: [{', '.join(ALL_LINEAR)}]")
    else:
        lora["target_modules"] = [t.strip() for t in target.split(",") if t.strip()]


def _scheduler(data: dict, notes: list[str]) -> None:
    sched = data.get("lr_schedule")
    if not isinstance(sched, dict):
        return
    kind = sched.get("type")
    if isinstance(kind, str) and kind in SCHEDULER_NAMES:
        sched["type"] = SCHEDULER_NAMES[kind]
        notes.append(f"{kind} -> lr_schedule.type: {sched['type']} (after the warmup)")
