"""The error the KV-cache bookkeeping raises for bad configuration or misuse."""


class KVCacheError(ValueError):
    """Invalid block-manager configuration or call (the message names the problem)."""


class OutOfBlocksError(KVCacheError):
    """An allocation was asked for more blocks than are free; ask ``can_allocate``/``can_append``
    first."""
