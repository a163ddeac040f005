"""The worker: the model runner, its persistent input batch, the KV cache tensors, tensor-parallel ranks."""

from __future__ import annotations


def make_model_runner(config):
    """The model runner for `config`, holding the model (its KV cache comes later, `initialize_kv_cache`, once the
    engine core has sized the pool): a `ModelRunner` in this process, or with tensor_parallel_size > 1 a
    `TensorParallelRunner`, rank 0 of a group of processes. vLLM's executor makes the same choice; nothing
    outside this package names either class."""
    if config.parallel_config.tensor_parallel_size > 1:
        from roseinfer.worker.tp_worker import TensorParallelRunner

        return TensorParallelRunner(config)  # every rank loads its shard of the model
    from roseinfer.worker.model_runner import ModelRunner

    return ModelRunner(config)
