"""What stages read and write: run records (JSONL), the hidden-state store, prompt datasets,
the local model's converted files."""
