"""Pipeline stages: each reads files, writes files, and runs alone (`python -m kimi_pipe.<stage>`)."""
