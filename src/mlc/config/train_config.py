"""The LoRA fine-tuning schema (`mlc-cli train --config lora.yaml`), shaped like the reference tutorial's lora_config.

Every default is the value the template (`config/templates/lora.yaml`) documents. Unknown keys are errors;
`mlc.config.loader` reads the file and reports a bad key or value with the file, the key and the allowed values.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlc.config.train_aliases import normalize_train_aliases

# The reference tutorial's (MindFormers/GLM) projection names -> the HF names transformers' Llama/GLM models use.
TARGET_MODULE_ALIASES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "dense": "o_proj"}
Precision = Literal["auto", "fp32", "bf16", "fp16"]
Stage = Literal["sft", "dpo", "kto", "rm"]
PrefLoss = Literal["sigmoid", "ipo", "orpo", "simpo"]
PREF_STAGES = ("dpo", "kto", "rm")
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class DataConfig(_Section):
    """`train`/`eval`: a JSONL file (tokenized when the run starts) or a `mlc-cli preprocess` output dir.

    Relative paths are read from the current directory; the defaults are the dataset shipped in the repo."""

    train: str = "data/customer_service.jsonl"
    eval: str | None = "data/customer_service_eval.jsonl"
    format: Literal["auto", "instruction", "alpaca", "chat", "sharegpt"] = "auto"
    pad_to_multiple_of: int = Field(16, ge=1)
    packing: bool = False
    on_error: Literal["skip", "fail"] = "skip"


class OptimizerConfig(_Section):
    """AdamW; the tutorial's values (lr 2e-4, eps 1e-6, betas 0.9/0.999)."""

    type: Literal["AdamW"] = "AdamW"
    lr: float = Field(2e-4, gt=0.0)
    eps: float = Field(1e-6, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0.0)

    @field_validator("type", mode="before")
    @classmethod
    def _type_alias(cls, v):
        # MindFormers calls it AdamWeightDecay; case-insensitive spellings of AdamW are the same optimizer.
        return "AdamW" if isinstance(v, str) and v.lower() in ("adamw", "adamweightdecay") else v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class LRScheduleConfig(_Section):
    """Linear warmup (`warmup_steps`, or `warmup_ratio` of the total steps), then `type` decay to 0."""

    type: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)

    def warmup_for(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * total_steps)


class LoraSection(_Section):
    """PEFT LoRA. `target_modules` accepts HF names (q_proj, ...) and the tutorial's query/key/value/dense."""

    r: int = Field(64, ge=1)
    alpha: float = Field(64, gt=0)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["query", "value"], min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v):
        return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v):
        bad = [m for m in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", m)]
        if bad:
            raise ValueError(f"{bad} are not module names; use e.g. q_proj, v_proj or query, value")
        return v

    def resolved_target_modules(self) -> list[str]:
        """Aliases mapped to HF names, order kept, duplicates dropped."""
        return list(dict.fromkeys(TARGET_MODULE_ALIASES.get(m, m) for m in self.target_modules))


class TrainConfig(_Section):
    """One LoRA run. Steps are optimizer steps (each `batch_size * gradient_accumulation_steps * nproc` rows)."""

    model: str = "smollm2-135m-instruct"
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    lora: LoraSection = Field(default_factory=LoraSection)
    batch_size: int = Field(4, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)  # wins over epochs when both are set
    epochs: float | None = Field(None, gt=0)  # None and no max_steps -> 1 epoch
    clip_norm: float | None = Field(1.0, gt=0)  # None disables clipping (the norm is still logged)
    precision: Precision = "auto"  # auto: fp32 on CPU, bf16 on CUDA/NPU
    device: str = "cpu"
    seed: int = 42
    max_seq_len: int = Field(512, ge=16)
    train_on_prompt: bool = False
    save_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    eval_every: int | None = Field(None, ge=1)  # None: evaluate before training and at the end only
    log_every: int = Field(1, ge=1)
    max_consecutive_bad_steps: int = Field(5, ge=1)
    output_dir: str = "runs/lora"
    # data-parallel processes (torchrun); `--nproc` wins; tutorial: parallel_config.data_parallel
    nproc: int = Field(1, ge=1)
    tensor_parallel: int = Field(1, ge=1)  # ranks each copy of the model is split over; tutorial: model_parallel
    # lora: the frozen base as loaded; qlora: its decoder's linear layers stored 4-bit (LLaMA-Factory's
    # quantization_bit: 4), the adapter as lora.dtype says
    finetuning_type: Literal["lora", "qlora"] = "lora"
    # Preference stages (LLaMA-Factory's keys): dpo (pref_loss sigmoid/ipo/orpo/simpo), kto, rm (a reward head).
    stage: Stage = "sft"
    pref_loss: PrefLoss = "sigmoid"
    pref_beta: float = Field(0.1, gt=0.0)
    simpo_gamma: float = Field(0.5, ge=0.0)  # SimPO's target margin
    pref_ftx: float = Field(0.0, ge=0.0)  # weight of the chosen replies' SFT loss added to a dpo loss
    kto_chosen_weight: float = Field(1.0, gt=0.0)  # KTO's desirable weight
    kto_rejected_weight: float = Field(1.0, gt=0.0)  # KTO's undesirable weight

    @model_validator(mode="after")
    def _check(self):
        if self.max_seq_len % self.data.pad_to_multiple_of:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must be a multiple of data.pad_to_multiple_of "
                f"({self.data.pad_to_multiple_of})"
            )
        if self.stage in PREF_STAGES:
            self._check_preference()
        if self.finetuning_type == "qlora" and self.tensor_parallel > 1:
            raise ValueError("finetuning_type: qlora is not built for tensor_parallel > 1 yet; set tensor_parallel: 1 "
                             "(data-parallel processes, nproc, work) or finetuning_type: lora")
        return self

    def _check_preference(self) -> None:
        """What a preference stage cannot run with, named before any model loads."""
        if self.tensor_parallel > 1 or self.nproc > 1:
            raise ValueError(f"stage: {self.stage} runs in one process for now; set nproc: 1 and tensor_parallel: 1 "
                             "(or train stage: sft across processes)")
        if self.data.packing:
            raise ValueError(f"stage: {self.stage} scores whole replies; set data.packing: false")
        if self.stage == "kto" and self.batch_size < 2:
            raise ValueError("stage: kto estimates its KL term from mismatched pairs within a batch; "
                             "set batch_size: 2 or more")
        if "train" not in self.data.model_fields_set:
            example = "data/kto_support.jsonl" if self.stage == "kto" else "data/pref_support.jsonl"
            raise ValueError(f"stage: {self.stage} needs {'labelled' if self.stage == 'kto' else 'pairwise'} data; "
                             f"set data.train (e.g. {example})")
        if "eval" not in self.data.model_fields_set:
            self.data.eval = None  # the default eval set is SFT rows

    @classmethod
    def normalize_aliases(cls, data: dict, notes: list[str] | None = None) -> tuple[dict, dict[str, str]]:
        return normalize_train_aliases(data, notes, OptimizerConfig.model_fields["betas"].default)

    def rows_per_step(self, world_size: int = 1) -> int:
        return self.batch_size * self.gradient_accumulation_steps * world_size

