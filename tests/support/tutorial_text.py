"""The reference tutorial's YAML files as it writes them (comments included), shared by the tests that feed them
to mlc: config/glm5_infer.yaml (sections 2.3 and 3.2) and configs/glm5/glm5_7b_lora.yaml (section 4.3)."""

GLM5_INFER_YAML = """\
attn_implementation: "flash"
use_paged_attn: True
kv_cache_dtype: "fp16"
attn_config:
  paged_attn: true
  page_size: 16
  sparse_kv_ratio: 0.25  # 保留25%的KV
"""

GLM5_7B_LORA_YAML = """\
optimizer:
  type: AdamWeightDecay
  learning_rate: 2e-4  # LoRA微调的黄金学习率
  eps: 1e-6
  beta1: 0.9
  beta2: 0.999

parallel_config:
  data_parallel: 2
  model_parallel: 2  # 4卡=2×2，平衡通信与计算
  pipeline_stage: 1

lora_config:
  lora_r: 64
  lora_alpha: 64
  lora_dropout: 0.1
  target_modules: ["query", "value"]  # 只微调Q/V，省显存
"""
