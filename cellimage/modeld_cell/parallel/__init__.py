"""Multi-rank cell shapes over torch.distributed (NCCL on CUDA, gloo on the CPU)."""
