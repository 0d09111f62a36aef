"""What a run directory bought: a resume with settings that buy something else is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kimi_pipe.generation.errors import GenerateError
from kimi_pipe.store.records import iter_records

# What a resume must buy the same way as the run it continues (never timeout_s, nor the
# api_base of a local server, which gets a new port each time).
PURCHASE_KEYS = ("model", "extra_body")
NOT_PURCHASE = frozenset({"timeout_s", "api_base"})


def _purchase(request: dict[str, Any], ignore_pinning: bool = False) -> dict[str, Any]:
    out = {k: v for k, v in request.items() if k not in NOT_PURCHASE}
    routing = (out.get("extra_body") or {}).get("provider")
    if ignore_pinning and isinstance(routing, dict):
        # serving=auto pins the job to the providers its probes fitted, and re-pins it when
        # the route changes: that pin is the job's own, every record names its provider.
        routing = {k: v for k, v in routing.items() if k not in ("only", "order")}
        out["extra_body"] = {**out["extra_body"], "provider": routing}
    return out


def refuse_other_purchase(
    records_path: Path, request: dict[str, Any], ignore_pinning: bool = False
) -> None:
    """A run directory holds one job: refuse to resume it with settings that buy something
    else (another model, routing, sampling parameters), naming both."""
    recorded = next(
        (
            rec.get("request")
            for rec in iter_records(records_path)
            if isinstance(rec.get("request"), dict)
        ),
        None,
    )
    if recorded is None:
        return
    old, new = _purchase(recorded, ignore_pinning), _purchase(request, ignore_pinning)
    if old == new:
        return
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    diff = "; ".join(
        f"{k}: recorded {json.dumps(old.get(k), sort_keys=True)}, now "
        f"{json.dumps(new.get(k), sort_keys=True)}"
        for k in keys
    )
    raise GenerateError(
        f"{records_path.parent} holds a run bought with other settings ({diff}); resuming "
        "would mix them. Use another output_dir (the default one is derived from these "
        "settings) or run with the recorded settings"
    )
