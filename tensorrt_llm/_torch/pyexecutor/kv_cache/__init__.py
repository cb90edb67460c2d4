"""kv_cache: pool specs and budget split, the block pool with prefix hashing, the paged KVCacheManager."""
