"""Yield counted in tokens and dollars (pure, no IO): of the completion tokens bought, how
many reach training as exact, per evidence rung, and what each exact token cost.

A user pays per token, so a record thrown away whole for one ambiguous id costs all of its
tokens; a proven prefix keeps most of them. Counted over answered records:
  bought       completion tokens billed (usage.completion_tokens; the reconstructed count
               where no usage came back)
  exact        output ids exact on the record's rung (core/prefix.exact_output_tokens: a
               prefix_proven record counts its prefix only); `exact_by_rung` per rung
  accepted     exact tokens of records the accept policy lets reach training files
  drawn        output ids that reach training files but were DRAWN, not bought (records
               `posterior_sampled` under a policy that names that rung; their proven
               prefix, if any, is counted as exact): never counted as exact
Cost per exact token: the listed output price times the tokens bought, over the accepted
exact tokens (what the listed price becomes per token that trains), and the whole spend
(prompts and failed attempts too) over the same, where the spend is known.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kimi_pipe.core.evidence import (
    DEFAULT_ACCEPT,
    LADDER,
    POSTERIOR_SAMPLED,
    UNRESOLVED,
    evidence_of,
    taken_whole,
    usable,
)
from kimi_pipe.core.prefix import exact_output_tokens


def completion_tokens_bought(record: Mapping[str, Any]) -> int:
    """Completion tokens a record was billed for (module docstring: `bought`)."""
    reported = record.get("completion_tokens_reported")
    if isinstance(reported, int):
        return reported
    usage = record.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    rebuilt = record.get("completion_tokens_reconstructed")
    return rebuilt if isinstance(rebuilt, int) else len(record.get("output_ids") or [])


def token_yield(
    records: Iterable[Mapping[str, Any]],
    accept: Sequence[str] = DEFAULT_ACCEPT,
    *,
    price_out_per_token: float | None = None,
    spend_usd: float | None = None,
) -> dict[str, Any]:
    """The yield block of a summary, report or card (module docstring). A later record of
    an id replaces an earlier one, as extraction reads them."""
    latest: dict[Any, Mapping[str, Any]] = {}
    anonymous: list[Mapping[str, Any]] = []
    for record in records:
        if record.get("error"):
            continue
        if record.get("id") is None:
            anonymous.append(record)
        else:
            latest.pop(record["id"], None)
            latest[record["id"]] = record
    bought = 0
    by_rung = dict.fromkeys(LADDER, 0)
    bought_by_rung = dict.fromkeys(LADDER, 0)
    accepted = 0
    drawn = 0
    for record in [*latest.values(), *anonymous]:
        rung = evidence_of(record)
        paid = completion_tokens_bought(record)
        bought += paid
        bought_by_rung[rung] += paid
        exact = exact_output_tokens(record)
        if rung != UNRESOLVED:
            by_rung[rung] += exact
        if usable(record, accept):
            accepted += exact
            if rung == POSTERIOR_SAMPLED and taken_whole(record, accept):
                drawn += len(record.get("output_ids") or []) - exact
    return yield_block(
        accept, bought, bought_by_rung, by_rung, accepted, drawn, price_out_per_token, spend_usd
    )


def yield_block(
    accept: Sequence[str],
    bought: int,
    bought_by_rung: dict[str, int],
    by_rung: dict[str, int],
    accepted: int,
    drawn: int,
    price_out_per_token: float | None,
    spend_usd: float | None,
) -> dict[str, Any]:
    """The yield block from its counts (records here, or index digests in
    generation/summary.py): one shape, one set of derived prices."""
    listed = price_out_per_token * bought if price_out_per_token is not None else None
    per_exact = listed / accepted if listed is not None and accepted else None
    return {
        "accept": list(accept),
        "completion_tokens_bought": bought,
        "bought_by_rung": bought_by_rung,
        "exact_by_rung": by_rung,
        "exact_accepted": accepted,
        "exact_share": accepted / bought if bought else None,
        "drawn_accepted": drawn,
        "listed_usd_per_output_token": price_out_per_token,
        "listed_usd_per_exact_token": per_exact,
        "spend_usd_per_exact_token": spend_usd / accepted if spend_usd and accepted else None,
    }


def yield_line(block: Mapping[str, Any]) -> str:
    """One line for a summary printout: bought, exact, share, cost per exact token."""
    share = block.get("exact_share")
    listed = block.get("listed_usd_per_exact_token")
    spent = block.get("spend_usd_per_exact_token")
    parts = [
        f"completion tokens bought {block['completion_tokens_bought']}",
        f"exact for training {block['exact_accepted']}"
        + (f" ({100 * share:.1f} %)" if share is not None else ""),
    ]
    if block.get("drawn_accepted"):
        parts.append(
            f"DRAWN from the target's posterior, not bought ({POSTERIOR_SAMPLED}) "
            f"{block['drawn_accepted']}"
        )
    if listed is not None:
        parts.append(f"${listed * 1e6:.4g} per million exact tokens at the listed price")
    if spent is not None:
        parts.append(f"${spent * 1e6:.4g} per million spent")
    return "; ".join(parts)
