"""Pipeline stages: each reads and writes files and runs alone (`python -m kimi_pipe.<stage>`)."""
