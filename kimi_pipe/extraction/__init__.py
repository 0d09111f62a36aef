"""Hidden-state extraction: backends (hf, sglang), the shared capture loop, layer-id conventions."""
