"""A store's EAGLE-3 exports read back as the trainers read them, in this venv (no trainer
package needed): SpecForge `torch.load`, speculators `load_from_disk` + `hs_i.safetensors`,
ModelOpt `torch.load(weights_only=True)`, tokens JSONL. Shared by the miniature's tests in
`make test` (tests/test_kimi_miniature.py, the hf store) and in the sglang_cpu tier
(tests/test_sglang_cpu.py, SGLang's stores), so both stores are held to the same reading.

What is checked for every format: every sample of the store exactly once, its ids and loss mask
equal the store's (and the records', when given), its states equal the store's (the final state
in the format's convention: post-norm for SpecForge and ModelOpt, pre-norm for speculators).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.exporters import (
    INDEX_FILE,
    TOKENS_FILE,
    export,
    modelopt_path,
    specforge_path,
    speculators_path,
)
from kimi_pipe.store.conventions import rms_norm
from kimi_pipe.store.hidden_store import HiddenStore

EAGLE3_FORMATS = ("specforge", "speculators", "modelopt", "tokens")


def records_by_id(path: Path) -> dict[str, tuple[list[int], list[int]]]:
    """id -> (prompt + output ids, loss mask) of a token-records JSONL."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[str(r["id"])] = (r["prompt_ids"] + r["output_ids"], list(r["loss_mask"]))
    return out


def _ints(x: Any) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def _post_norm(store: HiddenStore, final: torch.Tensor) -> torch.Tensor:
    """The store's final state as SpecForge and ModelOpt hold it (post-norm), float32."""
    if store.manifest["final_state"] == "post_norm":
        return final.float()
    return rms_norm(final, store.manifest["final_norm"])


def read_back_exports(
    store_dir: Path,
    out_root: Path,
    formats: Sequence[str] = EAGLE3_FORMATS,
    *,
    target_model_path: Path | None = None,
    records: Mapping[str, tuple[list[int], list[int]]] | None = None,
) -> dict[str, torch.Tensor]:
    """Export `store_dir` in each of `formats` to `out_root/<fmt>` and read every file back,
    asserting the module's checks. Returns SpecForge's final state per sample id (the teacher
    its trainer feeds the LM head), float32 [L, H], when specforge is among the formats."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    store = HiddenStore(store_dir)
    hidden = int(store.manifest["hidden_size"])
    teacher: dict[str, torch.Tensor] = {}
    for fmt in formats:
        out = out_root / fmt
        export([store_dir], out, fmt, seed=0, target_model_path=target_model_path)
        index = [json.loads(line) for line in (out / INDEX_FILE).read_text().splitlines()]
        assert sorted(r["id"] for r in index) == sorted(store.ids), fmt  # every sample, once
        if fmt == "tokens":
            rows = [json.loads(line) for line in (out / TOKENS_FILE).read_text().splitlines()]
            assert sorted(r["id"] for r in rows) == sorted(store.ids)
            for r in rows:
                tokens = store.tokens(r["id"])
                assert r["input_ids"] == tokens["input_ids"].tolist(), r["id"]
                assert r["loss_mask"] == tokens["loss_mask"].tolist(), r["id"]
                if records is not None:
                    assert (r["input_ids"], r["loss_mask"]) == records[r["id"]], r["id"]
            continue
        ds = load_from_disk(str(out)) if fmt == "speculators" else None
        for row in index:
            sid = row["id"]
            s = store[sid]
            length = s["input_ids"].numel()
            if fmt == "specforge":
                data = torch.load(specforge_path(out, row["index"]))
                ids, mask = data["input_ids"], data["loss_mask"]
                aux = data["aux_hidden_state"]
                assert aux.shape == (1, length, 3 * hidden), (sid, aux.shape)
                aux = aux[0]
                final = data["hidden_state"].reshape(length, hidden)
                want = _post_norm(store, s["hidden_state"]).to(final.dtype)
                teacher[sid] = final.float()
            elif fmt == "speculators":
                assert ds is not None
                f = load_file(str(speculators_path(out, row["index"])))
                states = f["hidden_states"]
                assert states.shape == (length, 4, hidden), (sid, states.shape)
                ids, mask = ds[row["index"]]["input_ids"], ds[row["index"]]["loss_mask"]
                assert f["token_ids"].tolist() == _ints(ids)
                aux = states[:, :3].reshape(length, 3 * hidden)
                final = states[:, 3]  # speculators applies the norm itself: pre-norm
                want = s["hidden_state"].to(final.dtype)
            elif fmt == "modelopt":
                data = torch.load(modelopt_path(out, row["index"]), weights_only=True)
                assert data["hidden_states_prenorm"] is False
                ids, mask = data["input_ids"], data["loss_mask"]
                aux, final = data["aux_hidden_states"], data["hidden_states"]
                assert aux.shape == (length, 3 * hidden), (sid, aux.shape)
                want = _post_norm(store, s["hidden_state"]).to(final.dtype)
            else:
                raise ValueError(f"no reader for format {fmt!r}")
            assert _ints(ids) == s["input_ids"].tolist(), (fmt, sid)
            assert _ints(mask) == s["loss_mask"].tolist(), (fmt, sid)
            if records is not None:
                assert (_ints(ids), _ints(mask)) == records[sid], (fmt, sid)
            assert torch.equal(aux, s["aux_hidden_state"].to(aux.dtype)), (fmt, sid)
            assert torch.equal(final, want), (fmt, sid)
    return teacher
