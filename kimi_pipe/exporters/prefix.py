"""Exports honour a proven prefix: a prefix_proven sample reaches the files only as stored
cut at its prefix (extraction cuts it; a store extracted whole is not cut again here). And
what the card says of a source run's yield in tokens and dollars."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kimi_pipe.core.evidence import parse_accept
from kimi_pipe.core.prefix import training_ids
from kimi_pipe.core.token_yield import token_yield
from kimi_pipe.store.hidden_store import HiddenStore
from kimi_pipe.store.records import iter_records


def cut_to_prefix(store: HiddenStore, sample_id: str, record: Mapping[str, Any]) -> bool:
    """Whether the stored sample holds no id past the record's proven prefix, and those ids
    are the prefix's."""
    try:
        ids, _mask = training_ids(record)
    except ValueError:
        return False
    stored = store.tokens(sample_id)["input_ids"].tolist()
    return len(stored) <= len(ids) and stored == ids[: len(stored)]


def run_yield(
    records: Path, summary: Mapping[str, Any], accept: Sequence[str] | None
) -> dict[str, Any] | None:
    """A source run's yield (None: no records file): its records under the export's policy,
    at the listed output price and the spend its summary.json books."""
    if not records.exists():
        return None
    budget = summary.get("budget") or {}
    price = budget.get("price_out_usd_per_mtok") if isinstance(budget, Mapping) else None
    spend = summary.get("spend_usd")
    return token_yield(
        iter_records(records),
        parse_accept(accept),
        price_out_per_token=price / 1e6 if isinstance(price, int | float) else None,
        spend_usd=spend if isinstance(spend, int | float) else None,
    )
