"""`extract.backend=sglang`: EAGLE-3 states of the real target served by SGLang.

Modules: `settings` (EngineSettings, devices, version pin), `ranks` (the rank protocol, the
other ranks of an engine on this node and on other nodes), `scoring` (target resolution and
the split check through the engine), `runner` (the one module that touches SGLang's
internals, and the only one that imports SGLang), `backend` (SGLangBackend, open_backend,
run_extract, serve_follower_node). docs/sglang.md.
"""

from kimi_pipe.extraction.sglang.backend import (
    SGLangBackend,
    open_backend,
    run_extract,
    serve_follower_node,
)
from kimi_pipe.extraction.sglang.ranks import Rank, RankFactory, ScoringRank
from kimi_pipe.extraction.sglang.scoring import (
    SGLangNextTokenScorer,
    SGLangSuffixScorer,
    SGLangTarget,
)
from kimi_pipe.extraction.sglang.settings import (
    CPU_ENGINE_ENV,
    DEVICES,
    INSTALL_HINT,
    SGLANG_VERSION,
    EngineSettings,
    node_ranks,
)

__all__ = [
    "CPU_ENGINE_ENV",
    "DEVICES",
    "INSTALL_HINT",
    "SGLANG_VERSION",
    "EngineSettings",
    "Rank",
    "RankFactory",
    "SGLangBackend",
    "SGLangNextTokenScorer",
    "SGLangSuffixScorer",
    "SGLangTarget",
    "ScoringRank",
    "node_ranks",
    "open_backend",
    "run_extract",
    "serve_follower_node",
]
