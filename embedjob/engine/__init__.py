"""Packing items under budgets, CUDA graph capture and replay, batch encoding (see ARCHITECTURE.md)."""
