"""Reading the input, writing the output, and the checkpoint that makes a shard resumable (see ARCHITECTURE.md)."""
