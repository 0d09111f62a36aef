"""Generation: buying answers under a budget, and the probes bought the same way."""
