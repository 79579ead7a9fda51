from jvllm.memory.block_pool import BlockPool, KVCacheManager  # noqa: F401
