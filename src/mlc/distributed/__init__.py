"""Tensor and expert parallelism over torch.distributed (gloo on CPU, nccl on CUDA, hccl on Ascend)."""
