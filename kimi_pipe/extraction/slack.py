"""The judge's slack: how far past the sampler's edge a token still counts as drawable.
Plain numbers, no torch: read by the settings that choose between them
(resolve_settings.py) and by the sampler that applies them (sampler.py)."""

# A token this close to the nucleus edge is kept: the provider sampled with its own numerics
# and the target recomputes with others, so an option is only called impossible when the
# difference cannot admit it. The default for `resolve.nucleus_slack`; its measurement is in
# docs/resolve.md ("Numerics at the nucleus edge").
NUCLEUS_SLACK = 1e-5
# Greedy (temperature 0): a token this close to the top logit (relative) may be the argmax of
# another engine's float32 run of the same weights (cached vs full forwards differ by ~1e-5).
GREEDY_SLACK = 1e-4
# A judge computing in bfloat16/float16 differs from the provider by more: measured on the
# demo's greedy answers, hf in bfloat16 puts the float32 argmax up to 0.6 % (relative) below
# its own top logit, and SGLang's AMX kernels err up to 3x more than hf's bfloat16 run
# (docs/resolve.md, "Numerics at the nucleus edge").
LOW_PRECISION_GREEDY_SLACK = 2e-2
LOW_PRECISION_NUCLEUS_SLACK = 1e-3
