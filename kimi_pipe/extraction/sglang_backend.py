"""`extract.backend=sglang`: EAGLE-3 states of the real target, served by SGLang on GPUs
(`extract.device=cuda`, the default) or by SGLang's CPU engine (`extract.device=cpu`: Intel
Xeon with AVX-512 + AMX, the venv of `make sglang-cpu`; docs/sglang.md). Both devices run the
same capture code below; what differs per device is named where it happens (`_on_cuda`).

The ONLY module that imports SGLang (lazily, so the package imports without it), pinned to
``SGLANG_VERSION`` by the optional extra ``pip install '.[sglang]'``. Everything
version-specific is in `_RankRunner`; the rest is plain Python the unit tests run without
a GPU through the same `SGLangBackend` code path with a stand-in rank.

Why internals and not `sglang.Engine`: the public API returns only the final layer, as Python
lists (SGLang issue #8003: 4x-15x slower). Here, per tensor-parallel rank:

* `ModelRunner` is built as `sglang.bench_one_batch.load_model` does (radix cache off, CUDA
  graphs off, chunked prefill off: one extend pass per batch sees every token);
* `set_eagle3_layers_to_capture` selects the auxiliary layers; the resulting capture ids are
  checked against `extraction.layers` (SGLang's DeepSeek model only adds 1 when the first id
  is 1, so the ids are set explicitly when its rule disagrees);
* every `LogitsProcessor` is replaced by `_StatesOnlyHead`, which returns the auxiliary states
  and the post-norm final state and never multiplies by the LM head (no [T, vocab] logits);
* the batch is fed as token ids (`Req.origin_input_ids`), never re-tokenised, and the states
  are copied to host memory as whole tensors (no `tolist`).

Tensor parallelism: rank 0 lives in the calling process and returns the states; ranks
1..tp-1 are spawned processes that run the same forwards (the states are replicated after
the all-reduce, so rank 0's copy is complete). An out-of-memory on any rank is agreed on by
all ranks (all-reduce of a flag) so they all retry the halved batch together.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.layers import output_to_capture_ids, resolve_output_ids
from kimi_pipe.extraction.output_head import read_output_head
from kimi_pipe.extraction.resolve import Sampling, sampled_logprobs
from kimi_pipe.extraction.split_check import sampler_log_table

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.14"  # keep equal to the pin of the `sglang` extra in pyproject.toml
INSTALL_HINT = (
    f"install sglang=={SGLANG_VERSION} on a machine with NVIDIA GPUs: `pip install '.[sglang]'`, "
    f"or in a separate venv `pip install sglang=={SGLANG_VERSION}` then "
    "`pip install --no-deps -e .`; on an Intel Xeon CPU with AMX: `make sglang-cpu` and run "
    "with .venv-sglang/bin/python (docs/sglang.md)"
)
DEVICES = ("cuda", "cpu")
# SGLang decides CPU vs CUDA once, at import, from this variable (sglang.srt.utils.is_cpu).
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
_FOLLOWER_TIMEOUT_S = 3600.0  # one forward of a long batch on a 1T model can take minutes


# --- settings (pure, tested without SGLang) -----------------------------------------------------
@dataclass(frozen=True)
class EngineSettings:
    """What `conf/extract/sglang.yaml` says about the engine."""

    model_path: str
    device: str = "cuda"  # cuda | cpu: SGLang's `device` server argument
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float | None = 0.85
    dtype: str = "bfloat16"
    max_len: int | None = None
    disable_radix_cache: bool = True
    disable_cuda_graph: bool = True
    trust_remote_code: bool = False
    load_format: str = "auto"
    base_gpu_id: int = 0
    # KV pool size in tokens; None = SGLang sizes it from mem_fraction_static (of GPU memory;
    # on CPU, of host memory, which is shared with everything else: set it there).
    max_total_tokens: int | None = None
    server_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(
                f"extract.device must be one of {DEVICES} (or auto), not {self.device!r}"
            )
        if self.tp_size < 1 or self.ep_size < 1 or self.dp_size < 1:
            raise ConfigError("extract.tp_size, ep_size and dp_size must be >= 1")
        if self.tp_size % self.ep_size:
            raise ConfigError(
                f"extract.ep_size={self.ep_size} must divide tp_size={self.tp_size} (SGLang "
                "places experts across the tensor-parallel ranks)"
            )
        if self.dp_size != 1:
            # dp>1 in SGLang means DP attention, which scatters the hidden states across
            # ranks; data parallelism here is done by work shards (extract.num_shards).
            raise ConfigError(
                "extract.dp_size > 1 is not supported for capture; run data-parallel copies "
                "as work shards instead (extract.shard=i extract.num_shards=n, one per GPU group)"
            )
        if not self.disable_radix_cache:
            raise ConfigError(
                "extract.disable_radix_cache must stay true: a prefix-cache hit skips the "
                "states of the cached prompt tokens (SGLang issue #8066)"
            )

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> EngineSettings:
        ecfg = cfg.extract
        path = ecfg.get("model_path") or OmegaConf.select(cfg, "model.hf_weights", default=None)
        if not path:
            raise ConfigError(
                "extract.backend=sglang needs the target model: set extract.model_path=DIR "
                "(a Hugging Face model directory, e.g. a local copy of moonshotai/Kimi-K2.5)"
            )
        extra = ecfg.get("server_args") or {}
        device = str(ecfg.get("device") or "cuda")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        max_total = ecfg.get("max_total_tokens")
        if max_total is None and device == "cpu":
            # One batch at a time lives in the pool: size it to the batch, not to host memory.
            max_total = ecfg.get("batch_tokens")
        return cls(
            model_path=str(Path(str(path)).expanduser()),
            device=device,
            tp_size=int(ecfg.get("tp_size", 1)),
            dp_size=int(ecfg.get("dp_size", 1)),
            ep_size=int(ecfg.get("ep_size", 1)),
            mem_fraction_static=ecfg.get("mem_fraction_static"),
            dtype=str(ecfg.get("dtype", "bfloat16")),
            max_len=ecfg.get("max_len"),
            disable_radix_cache=bool(ecfg.get("disable_radix_cache", True)),
            disable_cuda_graph=bool(ecfg.get("disable_cuda_graph", True)),
            trust_remote_code=bool(ecfg.get("trust_remote_code", False)),
            load_format=str(ecfg.get("load_format", "auto")),
            base_gpu_id=_base_gpu_id(cfg) if device == "cuda" else 0,
            max_total_tokens=int(max_total) if max_total is not None else None,
            server_args=dict(OmegaConf.to_container(extra, resolve=True)) if extra else {},  # type: ignore[arg-type]
        )

    def server_args_kwargs(self, nccl_port: int) -> dict[str, Any]:
        """Keyword arguments of `sglang.srt.server_args.ServerArgs` for capture."""
        kwargs: dict[str, Any] = {
            "model_path": self.model_path,
            "device": self.device,
            "tp_size": self.tp_size,
            "ep_size": self.ep_size,
            "dtype": self.dtype,
            "trust_remote_code": self.trust_remote_code,
            "load_format": self.load_format,
            "skip_tokenizer_init": True,  # ids come from the records, never re-tokenised
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,  # one extend pass per batch: every token's states
            "enable_return_hidden_states": True,
            "disable_overlap_schedule": True,
            "nccl_port": nccl_port,
        }
        if self.mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = float(self.mem_fraction_static)
        if self.max_total_tokens is not None:
            kwargs["max_total_tokens"] = int(self.max_total_tokens)
        if self.disable_cuda_graph:
            kwargs["disable_cuda_graph"] = True
        # Free-form extras last: the user's word wins (e.g. attention_backend, quantization).
        kwargs.update(self.server_args)
        return kwargs


# --- the rank interface (the real one needs a GPU; tests use a stand-in) ----------------------
class Rank(Protocol):
    """One tensor-parallel rank of the engine."""

    num_layers: int
    hidden_size: int
    max_total_tokens: int
    max_requests: int

    def set_layers(self, output_ids: Sequence[int]) -> list[int]:
        """Capture these "output of layer" ids; returns the capture ids in effect. A rank that
        overrode the engine's own choice may set `overridden_capture_ids` (the manifest
        records them as sglang_default_capture_ids)."""
        ...

    def forward(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Packed states of the batch, [sum L, k*H] and [sum L, H] (rank 0; others None).
        Raises torch.OutOfMemoryError on all ranks when any rank ran out of memory."""
        ...

    def close(self) -> None: ...


class ScoringRank(Rank, Protocol):
    """A rank that also returns the engine's logits (target resolution and the split check)."""

    def logits(
        self, prefix: list[int], continuations: list[list[int]], rows: list[list[int]]
    ) -> list[torch.Tensor] | None:
        """The KV of `prefix` is computed once in the engine's pool; every continuation is then
        extended on it, all in one batch (prefix sharing, as SGLang's radix cache does). Per
        continuation, the float32 logits [len(rows[i]), vocab] of its positions `rows[i]` (row
        j = continuation token j, predicting the token after it). Rank 0; others None."""
        ...


RankFactory = Callable[[EngineSettings, int, int], Rank]  # (settings, tp_rank, nccl_port)
# What rank 0 sends its followers: a capture batch, or ("logits", prefix, continuations, rows).
LOGITS_REQUEST = "logits"


def _base_gpu_id(cfg: DictConfig) -> int:
    """First GPU of this work shard: extract.base_gpu_id, else shard * tp_size modulo the
    visible GPUs (shards launched together on one node take disjoint GPU groups; a SLURM job
    sees only its own GPUs, so it starts at 0)."""
    value = cfg.extract.get("base_gpu_id")
    if value is not None:
        return int(value)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        return 0
    shard = int(cfg.extract.get("shard", 0) or 0)
    return (shard * int(cfg.extract.get("tp_size", 1))) % visible


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _follower_main(
    factory: RankFactory,
    settings: EngineSettings,
    tp_rank: int,
    nccl_port: int,
    output_ids: list[int],
    inbox: Any,
    outbox: Any,
) -> None:
    """Ranks 1..tp-1: run every forward rank 0 runs, report ok/oom/error."""
    try:
        rank = factory(settings, tp_rank, nccl_port)
        rank.set_layers(output_ids)
        outbox.put(("ready", tp_rank, None))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises
        outbox.put(("error", tp_rank, f"{type(exc).__name__}: {exc}"))
        return
    while True:
        batch = inbox.get()
        if batch is None:
            rank.close()
            return
        try:
            if isinstance(batch, tuple) and batch[0] == LOGITS_REQUEST:
                rank.logits(*batch[1:])  # type: ignore[attr-defined]
            else:
                rank.forward(batch)
            outbox.put(("ok", tp_rank, None))
        except torch.OutOfMemoryError:
            outbox.put(("oom", tp_rank, None))
        except Exception as exc:  # noqa: BLE001
            outbox.put(("error", tp_rank, f"{type(exc).__name__}: {exc}"))
            return


class SGLangBackend:
    """Extraction backend: `forward(batch) -> [(aux [L, k*H], final [L, H]), ...]`."""

    packed = True  # SGLang packs a batch without padding: its cost is the sum of lengths

    def __init__(
        self,
        settings: EngineSettings,
        *,
        layer_ids: Sequence[int] | None = None,
        model_cfg: dict[str, Any] | None = None,
        model_name: str | None = None,
        store_dtype: str | None = None,
        rank_factory: RankFactory | None = None,
    ) -> None:
        self.settings = settings
        factory = rank_factory or _sglang_rank
        self._followers: list[Any] = []
        self._inboxes: list[Any] = []
        nccl_port = _free_port()
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
        if settings.tp_size > 1:
            if output_ids is None:
                raise ValueError(
                    f"{settings.model_path}/config.json has no num_hidden_layers; set "
                    "extract.layer_ids explicitly for tensor-parallel capture"
                )
            ctx = mp.get_context("spawn")  # CUDA cannot be forked
            self._outbox = ctx.Queue()
            for r in range(1, settings.tp_size):
                inbox = ctx.Queue()
                proc = ctx.Process(
                    target=_follower_main,
                    args=(factory, settings, r, nccl_port, output_ids, inbox, self._outbox),
                    daemon=True,
                )
                proc.start()
                self._followers.append(proc)
                self._inboxes.append(inbox)
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
            self._wait_followers({"ready"})
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
            "final_state": "post_norm",
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
        backend = getattr(self.rank, "attention_backend", None)
        if backend:
            self.store_fields["extra"]["attention_backend"] = backend
        # The ids SGLang chose itself, when the rank had to override them (see set_layers).
        overridden = getattr(self.rank, "overridden_capture_ids", None)
        if overridden:
            self.store_fields["extra"]["sglang_default_capture_ids"] = list(overridden)

    def _wait_followers(self, ok: set[str]) -> bool:
        """Collect one status from every follower; True if any reported out-of-memory."""
        oom = False
        for _ in self._followers:
            status, rank, detail = self._next_status()
            if status == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {detail}")
            if status == "oom":
                oom = True
            elif status not in ok:
                raise RuntimeError(f"tensor-parallel rank {rank}: unexpected status {status!r}")
        return oom

    def _next_status(self) -> tuple[str, int, str | None]:
        """Next follower status; a follower that died without a word is an error too."""
        waited = 0.0
        while waited < _FOLLOWER_TIMEOUT_S:
            try:
                return self._outbox.get(timeout=5.0)  # type: ignore[no-any-return]
            except queue.Empty:
                waited += 5.0
            dead = [i + 1 for i, p in enumerate(self._followers) if not p.is_alive()]
            if dead:
                raise RuntimeError(f"tensor-parallel rank(s) {dead} exited; see their log above")
        raise RuntimeError(f"no answer from the tensor-parallel ranks in {_FOLLOWER_TIMEOUT_S}s")

    def forward(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        for inbox in self._inboxes:
            inbox.put(batch)
        own_oom = False
        packed: tuple[torch.Tensor, torch.Tensor] | None = None
        try:
            packed = self.rank.forward(batch)
        except torch.OutOfMemoryError:
            own_oom = True
        if self._wait_followers({"ok"}) or own_oom:
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
            for inbox in self._inboxes:
                inbox.put(request)
            own_oom = False
            got = None
            try:
                got = scorer(*request[1:])
            except torch.OutOfMemoryError:
                own_oom = True
            if self._wait_followers({"ok"}) or own_oom:
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
        for inbox in self._inboxes:
            inbox.put(None)
        for proc in self._followers:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
        self._followers.clear()
        self._inboxes.clear()
        rank = getattr(self, "rank", None)
        if rank is not None:
            rank.close()
            self.rank = None  # type: ignore[assignment]


class SGLangTarget:
    """The engine as target resolution sees it: logits of token rows (`SGLangBackend.logits`)
    and, for the split check, a `core.splits.NextTokenScorer` under a request's sampling
    (extraction.split_check.check_record asks a target that has `next_token_scorer`)."""

    def __init__(self, backend: SGLangBackend) -> None:
        self.backend = backend

    def next_token_scorer(self, sampling: Sampling) -> SGLangNextTokenScorer:
        return SGLangNextTokenScorer(self.backend, sampling)


class SGLangSuffixScorer:
    """`extraction.resolve.SuffixScorer` through the engine: the prefix's KV is computed once
    in SGLang's pool and every option's suffix is extended on it, in one batch (prefix
    sharing, as SGLang's radix cache does); the option's log-probability is the request's
    sampler (`resolve.sampled_logprobs`, as the hf scorer) over SGLang's logits."""

    def __init__(self, target: SGLangTarget, model_name: str) -> None:
        self.model = target  # the split check's target (records_pass._split_check_pass)
        self.model_name = model_name
        self.prefix_tokens = 0  # work done, for the cost report
        self.suffix_tokens = 0

    def score_suffixes(
        self, prefix: Sequence[int], suffixes: Sequence[Sequence[int]], sampling: Sampling
    ) -> list[float]:
        if not prefix:
            raise ValueError("target resolution needs a non-empty prefix (the prompt)")
        scored = [i for i, s in enumerate(suffixes) if s]  # an empty suffix adds nothing
        # The prefix's last token goes with each option: its row predicts the option's first
        # token, and the option's own tokens (less the last) predict the rest.
        conts = [[prefix[-1], *suffixes[i][:-1]] for i in scored]
        logits = self.model.backend.logits(
            list(prefix[:-1]), conts, [list(range(len(c))) for c in conts]
        )
        self.prefix_tokens += len(prefix) - 1
        self.suffix_tokens += sum(map(len, conts))
        scores = [0.0] * len(suffixes)
        for i, rows in zip(scored, logits, strict=True):
            scores[i] = sum(sampled_logprobs(rows, list(suffixes[i]), sampling))
        return scores


class SGLangNextTokenScorer:
    """`core.splits.NextTokenScorer` through the engine: one request over the ids, SGLang's
    logits of the rows asked for, the request's sampler (`split_check.sampler_log_table`)."""

    def __init__(self, backend: SGLangBackend, sampling: Sampling) -> None:
        self.backend = backend
        self.sampling = sampling
        self.tokens = 0  # forward work, for the cost report

    def logprobs_along(
        self, ids: Sequence[int], start: int, wanted: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        if not wanted:
            return []
        # Row start - 1 predicts ids[start]; SGLangBackend.logits refuses rows past the ids.
        (logits,) = self.backend.logits(
            [], [list(ids)], [range(start - 1, start - 1 + len(wanted))]
        )
        self.tokens += len(ids)
        table = sampler_log_table(logits, self.sampling)
        return [table[i, list(w)].tolist() for i, w in enumerate(wanted)]


def _num_layers_from_config(model_path: str) -> int | None:
    """num_hidden_layers from config.json (text_config first: Kimi K2.5 is a VLM wrapper)."""
    import json

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
    import importlib

    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"extract.rank_factory must look like 'module:callable', got {spec!r}")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def open_backend(cfg: DictConfig, rank_factory: RankFactory | None = None) -> SGLangBackend:
    """Build the backend from `cfg.extract` (conf/extract/sglang.yaml)."""
    settings = EngineSettings.from_cfg(cfg)
    if rank_factory is None and cfg.extract.get("rank_factory"):
        rank_factory = _import_factory(str(cfg.extract.rank_factory))
    if rank_factory is None and not Path(settings.model_path).exists():
        raise FileNotFoundError(
            f"{settings.model_path} not found: extract.model_path must be a local Hugging Face "
            "model directory (download it first, e.g. `huggingface-cli download "
            "moonshotai/Kimi-K2.5 --local-dir DIR`)"
        )
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True) if "model" in cfg else None
    layer_ids = cfg.extract.get("layer_ids")
    return SGLangBackend(
        settings,
        layer_ids=list(layer_ids) if layer_ids is not None else None,
        model_cfg=model_cfg,  # type: ignore[arg-type]
        model_name=OmegaConf.select(cfg, "model.name", default=None),
        store_dtype=cfg.extract.get("store_dtype"),
        rank_factory=rank_factory,
    )


def run_extract(cfg: DictConfig, rank_factory: RankFactory | None = None) -> dict[str, Any]:
    """The extract stage with this backend (`python -m kimi_pipe.extract extract=sglang`);
    `rank_factory` swaps the engine rank (tests)."""
    from kimi_pipe.extraction.sharding import run_sharded

    backend = open_backend(cfg, rank_factory)
    try:
        return run_sharded(cfg, backend)
    finally:
        backend.close()


# --- everything below is specific to SGLANG_VERSION ------------------------------------------
def _import_sglang(device: str = "cuda") -> Any:
    import os
    import sys

    if device == "cpu":
        already = "sglang.srt.utils.common" in sys.modules
        if already and os.environ.get(CPU_ENGINE_ENV) != "1":
            raise RuntimeError(
                f"SGLang was imported before {CPU_ENGINE_ENV}=1 was set, so it chose its CUDA "
                "engine; set it in the environment before anything imports sglang"
            )
        os.environ[CPU_ENGINE_ENV] = "1"
    elif os.environ.get(CPU_ENGINE_ENV) == "1":
        raise RuntimeError(
            f"{CPU_ENGINE_ENV}=1 is set but extract.device=cuda: SGLang would run on the CPU; "
            "unset it, or run with extract.device=cpu"
        )
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(f"extract.backend=sglang needs SGLang: {INSTALL_HINT}") from exc
    version = getattr(sglang, "__version__", "?")
    if version != SGLANG_VERSION:
        log.warning(
            "SGLang %s installed, this backend is written for %s; internals may differ (%s)",
            version,
            SGLANG_VERSION,
            INSTALL_HINT,
        )
    return sglang


class _StatesOnlyHead(torch.nn.Module):
    """Stands where the model's LogitsProcessor was: returns the states and computes no
    logits, except when the runner asks for the logits of chosen token rows (`logit_rows`,
    target resolution); those come from the replaced processor's own `_get_logits` (SGLang's
    LM head, logit scale, tensor-parallel gather, soft-capping), never for a whole batch."""

    def __init__(self, processor: Any = None) -> None:
        super().__init__()
        # A bound method, not the module: the processor must not stay a submodule of the model.
        self._get_logits = getattr(processor, "_get_logits", None)
        self.logit_rows: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        lm_head: Any,
        logits_metadata: Any,
        aux_hidden_states: list[torch.Tensor] | None = None,
        hidden_states_before_norm: torch.Tensor | None = None,
    ) -> _Captured | _Logits:
        if self.logit_rows is not None:
            if self._get_logits is None:
                raise RuntimeError("this head replaced no LogitsProcessor; it has no logits")
            from sglang.srt.layers.logits_processor import LogitsMetadata

            if not isinstance(logits_metadata, LogitsMetadata):
                logits_metadata = LogitsMetadata.from_forward_batch(logits_metadata)
            rows = hidden_states.index_select(0, self.logit_rows.to(hidden_states.device))
            return _Logits(self._get_logits(rows, lm_head, logits_metadata))
        if not aux_hidden_states:
            raise RuntimeError("the model returned no auxiliary states: capture is not enabled")
        # hidden_states is the last layer's output after the final norm, one row per token.
        return _Captured(torch.cat(aux_hidden_states, dim=-1), hidden_states)


@dataclass
class _Captured:
    aux: torch.Tensor
    final: torch.Tensor


@dataclass
class _Logits:
    logits: torch.Tensor  # float32 [rows, vocab]


def _replace_heads(model: torch.nn.Module, head_type: type) -> list[str]:
    """Put a `_StatesOnlyHead` wherever the model holds a `head_type` (SGLang's
    LogitsProcessor, e.g. `model.logits_processor`); returns the names replaced."""
    heads = [name for name, mod in model.named_modules() if isinstance(mod, head_type)]
    if not heads:
        raise RuntimeError("no SGLang LogitsProcessor found on the model; cannot skip logits")
    if "" in heads:
        raise RuntimeError("the model itself is a LogitsProcessor; unsupported")
    for name in heads:
        parent_name, _, child = name.rpartition(".")
        # get_submodule("") is the model itself: a head held directly by the model.
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _StatesOnlyHead(getattr(parent, child)))
    return heads


_OK, _OOM, _ERROR = 0, 1, 2  # per-forward status the tensor-parallel ranks all-reduce (MAX)


class _RankRunner:
    """One tensor-parallel rank on one GPU (or on the CPU's cores, `device="cpu"`), built
    like sglang.bench_one_batch.load_model."""

    device = "cuda"  # set per instance from EngineSettings.device

    def __init__(self, settings: EngineSettings, tp_rank: int, nccl_port: int) -> None:
        _import_sglang(settings.device)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs

        self.device = settings.device
        if _on_cuda(self.device) and not torch.cuda.is_available():
            raise ConfigError(f"extract.device=cuda needs a CUDA GPU; {INSTALL_HINT}")
        kwargs = settings.server_args_kwargs(nccl_port)
        if not _on_cuda(self.device):
            from sglang.srt.utils import cpu_has_amx_support, is_cpu

            if not is_cpu():
                raise RuntimeError(f"SGLang did not select its CPU engine ({CPU_ENGINE_ENV})")
            if not cpu_has_amx_support() and "attention_backend" not in kwargs:
                # SGLang's x86 default (intel_amx) is written for AMX; without it SGLang runs
                # its torch-native layers, and its torch-native attention goes with them.
                log.info("no AMX on this CPU: SGLang attention_backend=torch_native")
                kwargs["attention_backend"] = "torch_native"
        server_args = ServerArgs(**kwargs)
        # Env of NCCL/CUDA kernels and ulimits, per process; on CPU the CUDA variables are
        # set but read by nothing.
        _set_envs_and_config(server_args)
        initialize_moe_config(server_args)
        initialize_fp8_gemm_config(server_args)
        initialize_fp4_gemm_config(server_args)
        model_config = ModelConfig.from_server_args(server_args)
        self.tp_rank = tp_rank
        self.tp_size = settings.tp_size
        self.runner = ModelRunner(
            model_config=model_config,
            mem_fraction_static=server_args.mem_fraction_static,
            # On CPU the id names no device; SGLang's CPU runner binds OpenMP threads per rank
            # instead (SGLANG_CPU_OMP_THREADS_BIND).
            gpu_id=settings.base_gpu_id + tp_rank if _on_cuda(self.device) else 0,
            tp_rank=tp_rank,
            tp_size=settings.tp_size,
            moe_ep_rank=tp_rank // (settings.tp_size // settings.ep_size),
            moe_ep_size=settings.ep_size,
            pp_rank=0,
            pp_size=1,
            nccl_port=nccl_port,
            server_args=server_args,
        )
        self.runner.alloc_memory_pool()
        self.runner.init_attention_backends()
        self.runner.init_cuda_graphs()
        self.num_layers = int(model_config.num_hidden_layers)
        self.hidden_size = int(model_config.hidden_size)
        self.max_total_tokens = int(self.runner.max_total_num_tokens)
        self.max_requests = int(self.runner.req_to_token_pool.size)
        self.attention_backend = str(server_args.attention_backend)
        _replace_heads(self.runner.model, LogitsProcessor)
        self._cpu_group = None
        if self.tp_size > 1:
            from sglang.srt.distributed.parallel_state import get_world_group

            self._cpu_group = get_world_group().cpu_group

    def set_layers(self, output_ids: Sequence[int]) -> list[int]:
        model = self.runner.model
        model.set_eagle3_layers_to_capture(list(output_ids))
        expected = output_to_capture_ids(output_ids)
        holders = [m for m in model.modules() if hasattr(m, "layers_to_capture")]
        if not holders:
            raise RuntimeError("the SGLang model has no layers_to_capture; no EAGLE-3 support")
        self.overridden_capture_ids: list[int] | None = None
        for holder in holders:
            chosen = [int(i) for i in holder.layers_to_capture]
            if chosen != expected:
                # SGLang's DeepSeek/Kimi model adds 1 only when the first id is 1; state the
                # capture ids ourselves so every model follows kimi_pipe.layers.
                log.warning(
                    "SGLang chose capture ids %s for 'output of layer' ids %s; overriding with "
                    "capture ids %s (= ids + 1, the input of the next layer). Recorded in the "
                    "manifest as sglang_default_capture_ids / sglang_capture_ids.",
                    chosen,
                    list(output_ids),
                    expected,
                )
                self.overridden_capture_ids = chosen
                holder.layers_to_capture = list(expected)
        return list(holders[0].layers_to_capture)

    def _req(self, rid: str, ids: list[int], prefix_slots: torch.Tensor | None = None) -> Any:
        """One request over `ids`; with `prefix_slots`, the KV of ids[:len(prefix_slots)] is
        already in the pool at those slots and only the rest is computed (how SGLang's radix
        cache and bench_one_batch's correctness test hand a cached prefix to a request)."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=array("q", ids),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.fill_len = len(req.full_untruncated_fill_ids)
        req.logprob_start_len = -1
        if prefix_slots is not None:
            req.prefix_indices = prefix_slots.to(req.prefix_indices.dtype)
        req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
        return req

    def _run(self, reqs: list[Any]) -> Any:
        """One extend pass over the requests (as sglang.bench_one_batch.extend, without
        sampling); the head's output."""
        from sglang.bench_one_batch import TreeCacheNamespace, _maybe_prepare_mlp_sync_batch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        tree_cache = TreeCacheNamespace(
            page_size=runner.server_args.page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        sched = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        sched.prepare_for_extend()
        _maybe_prepare_mlp_sync_batch(sched, runner)
        if sched.input_ids is None and getattr(sched, "prefill_input_ids_cpu", None) is not None:
            sched.input_ids = sched.prefill_input_ids_cpu.to(sched.device, non_blocking=True)
            sched.prefill_input_ids_cpu = None
        return runner.forward(ForwardBatch.init_new(sched, runner)).logits_output

    def _extend(self, batch: list[list[int]]) -> _Captured:
        out = self._run([self._req(str(i), ids) for i, ids in enumerate(batch)])
        if not isinstance(out, _Captured):
            raise RuntimeError(f"expected captured states, SGLang returned {type(out).__name__}")
        return out

    def _extend_logits(
        self, prefix: list[int], continuations: list[list[int]], rows: list[list[int]]
    ) -> list[torch.Tensor]:
        heads = [m for m in self.runner.model.modules() if isinstance(m, _StatesOnlyHead)]
        slots = None
        try:
            if prefix:
                # The prefix alone first (no row asked for): its KV stays in the pool.
                for head in heads:
                    head.logit_rows = torch.empty(0, dtype=torch.long)
                first = self._req("prefix", prefix)
                self._run([first])
                pool = self.runner.req_to_token_pool.req_to_token
                slots = pool[first.req_pool_idx, : len(prefix)].clone()
            offsets, at = [], 0
            for cont in continuations:
                offsets.append(at)
                at += len(cont)
            wanted = [o + r for o, want in zip(offsets, rows, strict=True) for r in want]
            for head in heads:
                head.logit_rows = torch.tensor(wanted, dtype=torch.long)
            reqs = [self._req(f"c{i}", prefix + c, slots) for i, c in enumerate(continuations)]
            out = self._run(reqs)
        finally:
            for head in heads:
                head.logit_rows = None
        if not isinstance(out, _Logits):
            raise RuntimeError(f"expected logits, SGLang returned {type(out).__name__}")
        return list(torch.split(out.logits, [len(r) for r in rows], dim=0))

    def _agree(self, run: Callable[[], Any], what: str) -> Any:
        """Run one engine step on this rank; every rank then agrees on how it went (so all
        raise together, or none) and the pool is emptied for the next step."""
        status = _OK
        error: BaseException | None = None
        result = None
        try:
            result = run()
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks agree
            oom = isinstance(exc, torch.OutOfMemoryError) or (
                isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
            )
            status, error = (_OOM if oom else _ERROR), exc
        finally:
            self.runner.req_to_token_pool.clear()
            self.runner.token_to_kv_pool_allocator.clear()
        agreed = status
        if self._cpu_group is not None:
            # Every rank must reach this collective and take the same branch, whatever went
            # wrong, or the others block until the timeout (0 ok, 1 out of memory, 2 error).
            import torch.distributed as dist

            flag = torch.tensor([status])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group)
            agreed = int(flag.item())
        if agreed == _ERROR:
            if status == _ERROR and error is not None:
                raise error
            raise RuntimeError(f"another tensor-parallel rank failed {what}") from error
        if agreed == _OOM:
            _empty_cache(self.device)
            raise torch.OutOfMemoryError(f"out of memory {what}")
        return result

    @torch.no_grad()
    def forward(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        def capture() -> tuple[torch.Tensor, torch.Tensor] | None:
            captured = self._extend(batch)
            if self.tp_rank != 0:
                return None
            return _to_host(captured.aux), _to_host(captured.final)

        return self._agree(capture, f"capturing {len(batch)} sequences")  # type: ignore[no-any-return]

    @torch.no_grad()
    def logits(
        self, prefix: list[int], continuations: list[list[int]], rows: list[list[int]]
    ) -> list[torch.Tensor] | None:
        def score() -> list[torch.Tensor] | None:
            logits = self._extend_logits(prefix, continuations, rows)
            return [_to_host(t.float()) for t in logits] if self.tp_rank == 0 else None

        what = f"scoring {len(continuations)} continuations of a {len(prefix)}-token prefix"
        return self._agree(score, what)  # type: ignore[no-any-return]

    def close(self) -> None:
        del self.runner
        _empty_cache(self.device)


def _on_cuda(device: str) -> bool:
    return device == "cuda"


def _empty_cache(device: str) -> None:
    """Give cached device memory back (CUDA's caching allocator; the CPU has none)."""
    if _on_cuda(device):
        torch.cuda.empty_cache()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> host as one bulk tensor copy (the public API's per-value `tolist` is the slow
    part, SGLang #8003). Pageable, not pinned: the store keeps views of it until a shard is
    committed, and gigabytes of page-locked memory would be held that long. On CPU `.to("cpu")`
    would return the engine's own tensor, which may live in a buffer the next forward reuses:
    copy it."""
    if t.device.type == "cpu":
        return t.detach().clone()
    return t.to("cpu")


def _sglang_rank(settings: EngineSettings, tp_rank: int, nccl_port: int) -> Rank:
    return _RankRunner(settings, tp_rank, nccl_port)
