"""Disaggregated CTX/GEN serving: KV transfer over NIXL (transfer.py), worker routes (worker.py), router (router.py)."""
