"""Provider reports over finished runs: their data and their charts."""
