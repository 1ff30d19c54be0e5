"""Process groups of tensor and pipeline parallelism (torch.distributed only; the executors are in executor/)."""
