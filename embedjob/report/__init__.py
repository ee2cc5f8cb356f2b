"""The report of an output: counts in words, what it shows, the page and its figures (see ARCHITECTURE.md)."""
