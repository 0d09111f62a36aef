"""Pipeline stages: each reads and writes files and runs alone (`kimi-pipe <stage>`)."""
