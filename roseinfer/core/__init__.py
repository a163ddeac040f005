"""The core: requests, the scheduler and the KV cache manager. Token ids and block ids only: no text, no tensors."""
