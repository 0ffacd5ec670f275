"""Fine-tuning service: preprocess, the LoRA training recipe, checkpoints, evaluation and export."""
