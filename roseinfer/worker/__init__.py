"""The worker: the model runner, its persistent input batch, the KV cache tensors, tensor-parallel ranks."""
