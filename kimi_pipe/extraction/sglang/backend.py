"""`extract.backend=sglang`: EAGLE-3 states of the real target, served by SGLang on GPUs
(`extract.device=cuda`, the default) or by SGLang's CPU engine (`extract.device=cpu`: Intel
Xeon with AVX-512 + AMX, the venv of `make sglang-cpu`; docs/sglang.md). Both devices run the
same capture code; what differs per device is named where it happens (`runner._on_cuda`).

`SGLangBackend` is plain Python: rank 0 (`runner._RankRunner`, or a stand-in rank in the
tests) in this process, the other ranks in a `ranks.RankGroup` (this node's as spawned
processes; in a multi-node engine the other nodes' behind `ranks.serve_node`). The unit tests
run it without a GPU through the same code path with a stand-in rank.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.draft_config import capture_request, record_drafts
from kimi_pipe.extraction.job import ExtractJob
from kimi_pipe.extraction.layers import output_to_capture_ids, resolve_output_ids
from kimi_pipe.extraction.output_head import read_output_head
from kimi_pipe.extraction.sglang.ranks import (
    LOGITS_REQUEST,
    RankFactory,
    RankGroup,
    free_port,
    serve_node,
)
from kimi_pipe.extraction.sglang.runner import _sglang_rank
from kimi_pipe.extraction.sglang.scoring import SGLangSuffixScorer, SGLangTarget
from kimi_pipe.extraction.sglang.settings import SGLANG_VERSION, EngineSettings
from kimi_pipe.extraction.sharding import run_sharded
from kimi_pipe.store.conventions import PRE_NORM

log = logging.getLogger(__name__)


class SGLangBackend:
    """Extraction backend: `forward(batch) -> [(aux [L, k*H], final [L, H]), ...]`."""

    packed = True  # SGLang packs a batch without padding: its cost is the sum of lengths

    def __init__(
        self,
        settings: EngineSettings,
        *,
        layer_ids: Sequence[int] | None = None,
        model_cfg: Mapping[str, Any] | None = None,
        model_name: str | None = None,
        store_dtype: str | None = None,
        rank_factory: RankFactory | None = None,
    ) -> None:
        self.settings = settings
        if settings.node_rank != 0:
            raise ConfigError(
                f"extract.node_rank={settings.node_rank}: only the node of rank 0 opens the "
                "backend; the others serve their ranks (serve_follower_node)"
            )
        factory = rank_factory or _sglang_rank
        nccl_port = free_port()
        # Rank 0 needs the layer count before the ids can be resolved; followers get the same
        # ids, so they are resolved from the model's config.json when it is there.
        num_layers = _num_layers_from_config(settings.model_path)
        output_ids = (
            resolve_output_ids(
                list(layer_ids) if layer_ids is not None else None, num_layers, model_cfg
            )
            if num_layers is not None
            else None
        )
        self.others = RankGroup(factory, settings, nccl_port, output_ids)
        try:
            self.rank = factory(settings, 0, nccl_port)
            output_ids = resolve_output_ids(
                list(output_ids) if output_ids is not None else None,
                self.rank.num_layers,
                model_cfg,
            )
            self.capture_ids = self.rank.set_layers(output_ids)
            expected = output_to_capture_ids(output_ids)
            if list(self.capture_ids) != expected:
                raise RuntimeError(
                    f"SGLang captures {self.capture_ids}, expected {expected} for "
                    f"'output of layer' ids {output_ids}"
                )
            self.others.wait_nodes()
            self.others.wait({"ready"})
        except BaseException:
            self.close()
            raise
        self.layer_ids = output_ids
        self.num_layers = self.rank.num_layers
        self.hidden_size = self.rank.hidden_size
        # The KV pool holds one batch at a time: it caps the tokens and requests per batch.
        self.max_batch_tokens = self.rank.max_total_tokens
        self.max_batch_samples = self.rank.max_requests
        if settings.max_len is not None and settings.max_len > self.max_batch_tokens:
            log.warning(
                "extract.max_len=%d exceeds the KV pool (%d tokens): such samples will fail "
                "with capture_oom; raise mem_fraction_static or lower max_len",
                settings.max_len,
                self.max_batch_tokens,
            )
        self.store_fields: dict[str, Any] = {
            "model": model_name or Path(settings.model_path).name,
            "num_layers": self.num_layers,
            "layer_ids": list(self.layer_ids),
            "hidden_size": self.hidden_size,
            "dtype": store_dtype or settings.dtype,
            "layer_convention": "output_of_layer",
            "final_state": settings.final_state,
            "extra": {
                "engine": f"sglang=={SGLANG_VERSION}",
                "device": settings.device,
                "sglang_capture_ids": list(self.capture_ids),
                "tp_size": settings.tp_size,
                "ep_size": settings.ep_size,
                "compute_dtype": settings.dtype,
                "model_path": settings.model_path,
            },
        }
        if settings.final_state == PRE_NORM:
            # The norm's weight and eps, so export can compute the post-norm state exactly.
            spec = getattr(self.rank, "final_norm", None)
            if not spec:
                rank_type = type(self.rank).__name__
                self.close()
                raise RuntimeError(
                    f"extract.final_state=pre_norm: the engine rank {rank_type} "
                    "gave no final_norm (the pre-norm state and its norm); use "
                    "extract.final_state=post_norm"
                )
            self.store_fields["extra"]["final_norm"] = spec
        backend = getattr(self.rank, "attention_backend", None)
        if backend:
            self.store_fields["extra"]["attention_backend"] = backend
        # The ids SGLang chose itself, when the rank had to override them (see set_layers).
        overridden = getattr(self.rank, "overridden_capture_ids", None)
        if overridden:
            self.store_fields["extra"]["sglang_default_capture_ids"] = list(overridden)

    def forward(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.others.send(batch)
        own_oom = False
        packed: tuple[torch.Tensor, torch.Tensor] | None = None
        try:
            packed = self.rank.forward(batch)
        except torch.OutOfMemoryError:
            own_oom = True
        if self.others.wait({"ok"}) or own_oom:
            raise torch.OutOfMemoryError(f"out of memory capturing {len(batch)} sequences")
        assert packed is not None
        aux, final = packed
        lengths = [len(seq) for seq in batch]
        if aux.shape[0] != sum(lengths) or final.shape[0] != sum(lengths):
            raise RuntimeError(
                f"engine returned {aux.shape[0]} token rows for {sum(lengths)} tokens"
            )
        return list(
            zip(torch.split(aux, lengths, dim=0), torch.split(final, lengths, dim=0), strict=True)
        )

    def logits(
        self,
        prefix: Sequence[int],
        continuations: Sequence[Sequence[int]],
        rows: Sequence[Sequence[int]],
    ) -> list[torch.Tensor]:
        """`ScoringRank.logits` on every tensor-parallel rank. Continuations that do not fit
        the KV pool (or its request slots) with the prefix go in several steps, each on its
        own copy of the prefix."""
        scorer = getattr(self.rank, "logits", None)
        if scorer is None:
            raise RuntimeError(f"{type(self.rank).__name__} cannot return logits")
        for cont, want in zip(continuations, rows, strict=True):
            if any(not 0 <= r < len(cont) for r in want):
                raise ValueError(
                    f"logit rows {list(want)} outside a {len(cont)}-token continuation"
                )
        out: list[torch.Tensor] = []
        for group in self._logit_groups(len(prefix), [len(c) for c in continuations]):
            request = (
                LOGITS_REQUEST,
                list(prefix),
                [list(continuations[i]) for i in group],
                [list(rows[i]) for i in group],
            )
            self.others.send(request)
            own_oom = False
            got = None
            try:
                got = scorer(*request[1:])
            except torch.OutOfMemoryError:
                own_oom = True
            if self.others.wait({"ok"}) or own_oom:
                raise torch.OutOfMemoryError(
                    f"out of memory scoring {len(group)} continuations of a "
                    f"{len(prefix)}-token prefix"
                )
            assert got is not None
            out.extend(got)
        return out

    def _logit_groups(self, prefix_len: int, lengths: list[int]) -> list[list[int]]:
        """Consecutive continuations per engine step: prefix + theirs within the KV pool, one
        request slot each plus the prefix's."""
        groups: list[list[int]] = []
        tokens = prefix_len
        for i, n in enumerate(lengths):
            if prefix_len + n > self.max_batch_tokens:
                raise torch.OutOfMemoryError(
                    f"a {prefix_len}-token prefix and a {n}-token continuation exceed the KV "
                    f"pool ({self.max_batch_tokens} tokens)"
                )
            if (
                not groups
                or tokens + n > self.max_batch_tokens
                or (len(groups[-1]) + 2 > self.max_batch_samples)
            ):
                groups.append([])
                tokens = prefix_len
            groups[-1].append(i)
            tokens += n
        return groups

    def output_head(self) -> torch.Tensor:
        """The LM head from the checkpoint (the engine shards its own across ranks); on the
        GPU when the engine runs there (Kimi's, in float32: 4.7 GB)."""
        device = "cuda" if self.settings.device == "cuda" else "cpu"
        return read_output_head(self.settings.model_path, device)

    def suffix_scorer(self) -> SGLangSuffixScorer | None:
        """Target resolution's scorer on this engine (None: the rank returns no logits)."""
        if not hasattr(self.rank, "logits"):
            return None
        return SGLangSuffixScorer(SGLangTarget(self), str(self.store_fields["model"]))

    def close(self) -> None:
        others = getattr(self, "others", None)
        if others is not None:
            others.close()
        rank = getattr(self, "rank", None)
        if rank is not None:
            rank.close()
            self.rank = None  # type: ignore[assignment]


def _num_layers_from_config(model_path: str) -> int | None:
    """num_hidden_layers from config.json (text_config first: a VLM wraps its text model)."""
    path = Path(model_path) / "config.json"
    if not path.exists():
        return None
    cfg = json.loads(path.read_text())
    for section in (cfg.get("text_config") or {}, cfg):
        if "num_hidden_layers" in section:
            return int(section["num_hidden_layers"])
    return None


def _import_factory(spec: str) -> RankFactory:
    """ "module:callable" -> the callable (a stand-in engine rank for tests, or another engine)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"extract.rank_factory must look like 'module:callable', got {spec!r}")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def _factory_of(
    job: ExtractJob, settings: EngineSettings, rank_factory: RankFactory | None
) -> RankFactory | None:
    if rank_factory is None and job.get("rank_factory"):
        rank_factory = _import_factory(str(job.get("rank_factory")))
    if rank_factory is None and not Path(settings.model_path).exists():
        raise FileNotFoundError(
            f"{settings.model_path} not found: extract.model_path must be a local Hugging Face "
            "model directory (download it first, e.g. `huggingface-cli download "
            "moonshotai/Kimi-K2.5 --local-dir DIR`)"
        )
    return rank_factory


def open_backend(job: ExtractJob, rank_factory: RankFactory | None = None) -> SGLangBackend:
    """Build the backend from the job's `extract.*` (conf/extract/sglang.yaml). In a multi-node
    engine only the node of rank 0 opens it; the others run `serve_follower_node`."""
    settings = EngineSettings.from_job(job)
    rank_factory = _factory_of(job, settings, rank_factory)
    layer_ids, drafts = capture_request(
        job.get("layer_ids"), job.get("draft_config"), job.get("draft_engine")
    )
    backend = SGLangBackend(
        settings,
        layer_ids=list(layer_ids) if layer_ids is not None else None,
        model_cfg=job.model,
        model_name=job.model_name,
        store_dtype=job.get("store_dtype"),
        rank_factory=rank_factory,
    )
    record_drafts(backend.store_fields, drafts, int(backend.store_fields["num_layers"]))
    return backend


def run_extract(job: ExtractJob, rank_factory: RankFactory | None = None) -> dict[str, Any]:
    """The extract stage with this backend (`python -m kimi_pipe extract extract=sglang`);
    `rank_factory` swaps the engine rank (tests)."""
    backend = open_backend(job, rank_factory)
    try:
        return run_sharded(job, backend)
    finally:
        backend.close()


def serve_follower_node(job: ExtractJob, rank_factory: RankFactory | None = None) -> dict[str, Any]:
    """A node of a multi-node engine other than rank 0's (`extract.node_rank` > 0): run this
    node's tensor-parallel ranks until rank 0's node closes the engine. It claims no work and
    writes nothing; the executors start it beside the rank-0 worker (docs/distributed.md)."""
    settings = EngineSettings.from_job(job)
    if settings.nnodes < 2 or settings.node_rank == 0:
        raise ConfigError(
            "serve_follower_node is for extract.node_rank >= 1 of an engine with "
            f"extract.nnodes >= 2 (got node_rank={settings.node_rank}, nnodes={settings.nnodes})"
        )
    factory = _factory_of(job, settings, rank_factory) or _sglang_rank
    relayed = serve_node(settings, factory)
    return {
        "node_rank": settings.node_rank,
        "nnodes": settings.nnodes,
        "ranks": list(settings.local_ranks),
        "requests": relayed,
    }
