"""Worker processes and the one frame format for messages between processes (see ARCHITECTURE.md)."""
