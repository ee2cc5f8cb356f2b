"""Ranks of one shard and engines that run a job's shards (see ARCHITECTURE.md)."""
