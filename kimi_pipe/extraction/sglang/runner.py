"""`_RankRunner`: one tensor-parallel rank of SGLang's engine, built from its internals. The
ONLY module that imports SGLang, and only inside the functions below (SGLang is an optional
dependency, pinned to ``SGLANG_VERSION`` by the extra ``pip install '.[sglang]'``): the package
imports without it, and everything version-specific is here.

Why internals and not `sglang.Engine`: the public API returns only the final layer, as Python
lists (SGLang issue #8003: 4x-15x slower). Here, per tensor-parallel rank:

* `ModelRunner` is built as `sglang.bench_one_batch.load_model` does (radix cache off, CUDA
  graphs off, chunked prefill off: one extend pass per batch sees every token);
* `set_eagle3_layers_to_capture` selects the auxiliary layers; the resulting capture ids are
  checked against `extraction.layers` (SGLang's DeepSeek model only adds 1 when the first id
  is 1, so the ids are set explicitly when its rule disagrees);
* every `LogitsProcessor` is replaced by `_StatesOnlyHead`, which returns the auxiliary states
  and the post-norm final state and never multiplies by the LM head (no [T, vocab] logits);
  with `final_state=pre_norm`, a forward pre-hook on the text model's final norm
  (`_PreNormTap`) keeps the norm's input (hidden + residual) and the head returns that instead;
* the batch is fed as token ids (`Req.origin_input_ids`), never re-tokenised, and the states
  are copied to host memory as whole tensors (no `tolist`).

An out-of-memory on any rank is agreed on by all ranks (all-reduce of a flag over the world's
CPU group, every node's ranks included) so they all retry the halved batch together.
"""

from __future__ import annotations

import logging
import os
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction.layers import output_to_capture_ids
from kimi_pipe.extraction.sglang.ranks import Rank
from kimi_pipe.extraction.sglang.settings import (
    CPU_ENGINE_ENV,
    INSTALL_HINT,
    NCCL_LIBRARY_ENV,
    NO_NCCL_ON_CPU,
    SGLANG_VERSION,
    EngineSettings,
)
from kimi_pipe.store.conventions import PRE_NORM, final_norm_spec, rms_norm

log = logging.getLogger(__name__)


def _import_sglang(device: str = "cuda") -> Any:
    if device == "cpu":
        already = "sglang.srt.utils.common" in sys.modules
        if already and os.environ.get(CPU_ENGINE_ENV) != "1":
            raise RuntimeError(
                f"SGLang was imported before {CPU_ENGINE_ENV}=1 was set, so it chose its CUDA "
                "engine; set it in the environment before anything imports sglang"
            )
        os.environ[CPU_ENGINE_ENV] = "1"
        # SGLang builds a NCCL communicator for tp > 1 whenever it can load libnccl, which a
        # CUDA build of torch brings along even on a CPU-only host (the build `make
        # sglang-cpu` installs), and then fails on torch.cuda.device("cpu"). A library it
        # cannot load sends it down the path a CPU build of torch takes: gloo collectives.
        os.environ.setdefault(NCCL_LIBRARY_ENV, NO_NCCL_ON_CPU)
    elif os.environ.get(CPU_ENGINE_ENV) == "1":
        raise RuntimeError(
            f"{CPU_ENGINE_ENV}=1 is set but extract.device=cuda: SGLang would run on the CPU; "
            "unset it, or run with extract.device=cpu"
        )
    try:
        import sglang  # optional dependency: the sglang extra
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


class _PreNormTap:
    """Forward pre-hook on the text model's final norm, called as `norm(x)` or
    `norm(x, residual)` (SGLang's fused add + RMSNorm): keeps the norm's input, x + residual,
    the last layer's output. The sum is a new tensor, so the fused kernels that overwrite x
    and residual in place cannot change it; formed in float32 as SGLang's native RMSNorm
    forms it (the store casts it to its own dtype)."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        names = ("x", "residual", "post_residual_addition")
        given = dict(zip(names, args, strict=False)) | {k: kwargs[k] for k in names if k in kwargs}
        x = given.get("x")
        if not isinstance(x, torch.Tensor):
            raise RuntimeError(f"the final norm was called without its input tensor: {kwargs}")
        state = x.float()
        for extra in ("residual", "post_residual_addition"):
            if given.get(extra) is not None:
                state = state + given[extra].float()
        # x.float() of a float32 x is x itself, which a fused kernel may overwrite: copy it.
        self.state = state.clone() if state.data_ptr() == x.data_ptr() else state

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """The state kept for this forward, checked against the head's input `like` (one row
        per token, full hidden width); a missing or other-shaped state is an error."""
        state, self.state = self.state, None
        if state is None:
            raise RuntimeError("the final norm did not run in this forward; no pre-norm state")
        if state.shape != like.shape:
            raise RuntimeError(
                f"the final norm's input has shape {tuple(state.shape)}, the head's "
                f"{tuple(like.shape)}: the pre-norm state is not one full row per token here"
            )
        return state


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
        self.pre_norm: _PreNormTap | None = None  # set with final_state=pre_norm

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
            if self.pre_norm is not None:
                self.pre_norm.state = None  # not a capture: drop it
            if self._get_logits is None:
                raise RuntimeError("this head replaced no LogitsProcessor; it has no logits")
            from sglang.srt.layers.logits_processor import LogitsMetadata  # optional: sglang

            if not isinstance(logits_metadata, LogitsMetadata):
                logits_metadata = LogitsMetadata.from_forward_batch(logits_metadata)
            rows = hidden_states.index_select(0, self.logit_rows.to(hidden_states.device))
            return _Logits(self._get_logits(rows, lm_head, logits_metadata))
        if not aux_hidden_states:
            raise RuntimeError("the model returned no auxiliary states: capture is not enabled")
        # hidden_states is the last layer's output after the final norm, one row per token.
        final = hidden_states if self.pre_norm is None else self.pre_norm.take(hidden_states)
        return _Captured(torch.cat(aux_hidden_states, dim=-1), final)


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


def _tap_final_norm(model: torch.nn.Module, heads: list[_StatesOnlyHead]) -> dict[str, Any]:
    """Hook a `_PreNormTap` on the final norm of the text model that captures (the module
    holding `layers_to_capture`, e.g. Kimi K2.5's language_model.model) and hand it to the
    heads; returns the manifest's `final_norm` entry for that norm. The norm must compute
    x * rsqrt(mean(x^2) + eps) * weight, which export recomputes from the entry: checked on
    random rows through the module itself, before the hook is on."""
    holders = [(name, m) for name, m in model.named_modules() if hasattr(m, "layers_to_capture")]
    if len(holders) != 1:
        raise RuntimeError(
            f"extract.final_state=pre_norm: expected one text model holding layers_to_capture, "
            f"found {[n for n, _ in holders]}"
        )
    prefix, text_model = holders[0]
    norm = getattr(text_model, "norm", None)
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if not isinstance(norm, torch.nn.Module) or not isinstance(weight, torch.Tensor) or eps is None:
        raise RuntimeError(
            f"extract.final_state=pre_norm: {type(text_model).__name__} has no final RMSNorm at "
            "`.norm` (weight + variance_epsilon); use extract.final_state=post_norm"
        )
    spec = final_norm_spec(weight, float(eps), f"{prefix}.norm" if prefix else "norm")
    probe = torch.randn(4, weight.numel(), generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.dtype)
    with torch.no_grad():
        got = norm(probe.to(weight.device, copy=True))  # a fused kernel may write in place
    got = (got[0] if isinstance(got, tuple) else got).float().cpu()
    if not torch.allclose(rms_norm(probe, spec), got, rtol=1e-2, atol=1e-3):
        raise RuntimeError(
            f"extract.final_state=pre_norm: the final norm {type(norm).__name__} is not "
            "x * rsqrt(mean(x^2) + eps) * weight, so export could not recompute it; use "
            "extract.final_state=post_norm"
        )
    tap = _PreNormTap()
    norm.register_forward_pre_hook(tap, with_kwargs=True)
    for head in heads:
        head.pre_norm = tap
    return spec


_OK, _OOM, _ERROR = 0, 1, 2  # per-forward status the tensor-parallel ranks all-reduce (MAX)


def _torch_native_takes_absorbed_mla() -> None:
    """MLA models (DeepSeek-V2/V3, Kimi K2/K2.5) on SGLang's torch_native attention.

    SGLang 0.5.14 picks an MLA layer's attention method per backend from its own registry;
    torch_native has no entry, so it gets triton's: a prefill without a cached prefix (every
    capture batch) runs the MHA path, which hands the decompressed k and v to the backend with
    save_kv_cache=False, while torch_native's SDPA reads k and v from the KV pool, which for MLA
    holds the compressed latent. The dimensions then disagree ("Expected size for first two
    dimensions of batch2 tensor to be: [4, 24] but got: [4, 40]" on the miniature Kimi K2.5,
    docs/miniature.md). Registered for torch_native, SGLang's own `_dispatch_mla_subtype`
    takes the absorbed MLA path every time (what triton's handler does after a cached prefix):
    the latent is written to the pool and attended over, which torch_native's SDPA serves.
    Other models never ask the registry. Idempotent; each rank process calls it."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (  # optional: sglang
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    if "torch_native" not in AttentionBackendRegistry._handlers:
        AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)


class _RankRunner:
    """One tensor-parallel rank on one GPU (or on the CPU's cores, `device="cpu"`), built
    like sglang.bench_one_batch.load_model."""

    device = "cuda"  # set per instance from EngineSettings.device

    def __init__(self, settings: EngineSettings, tp_rank: int, nccl_port: int) -> None:
        _import_sglang(settings.device)
        # The optional dependency (sglang), imported only once the device is settled.
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.entrypoints.engine import _set_envs_and_config  # optional dep: sglang
        from sglang.srt.layers.logits_processor import LogitsProcessor  # optional dep: sglang
        from sglang.srt.layers.moe import initialize_moe_config  # optional dep: sglang
        from sglang.srt.layers.quantization.fp4_utils import (
            initialize_fp4_gemm_config,  # optional dep
        )
        from sglang.srt.layers.quantization.fp8_utils import (
            initialize_fp8_gemm_config,  # optional dep
        )
        from sglang.srt.model_executor.model_runner import ModelRunner  # optional dep: sglang
        from sglang.srt.server_args import ServerArgs  # optional dep: sglang

        self.device = settings.device
        if _on_cuda(self.device) and not torch.cuda.is_available():
            raise ConfigError(f"extract.device=cuda needs a CUDA GPU; {INSTALL_HINT}")
        kwargs = settings.server_args_kwargs(nccl_port)
        if not _on_cuda(self.device):
            from sglang.srt.utils import cpu_has_amx_support, is_cpu  # optional: sglang

            if not is_cpu():
                raise RuntimeError(f"SGLang did not select its CPU engine ({CPU_ENGINE_ENV})")
            if not cpu_has_amx_support() and "attention_backend" not in kwargs:
                # SGLang's x86 default (intel_amx) is written for AMX; without it SGLang runs
                # its torch-native layers, and its torch-native attention goes with them.
                log.info("no AMX on this CPU: SGLang attention_backend=torch_native")
                kwargs["attention_backend"] = "torch_native"
        if kwargs.get("attention_backend") == "torch_native":
            _torch_native_takes_absorbed_mla()
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
            # A multi-node engine's ranks count on from node to node; GPUs start at
            # base_gpu_id on each node (settings.gpu_of).
            gpu_id=settings.gpu_of(tp_rank) if _on_cuda(self.device) else 0,
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
        # The manifest's final_norm entry when the store keeps the pre-norm state (the backend
        # reads it from rank 0); None: the post-norm state, what the head receives.
        self.final_norm: dict[str, Any] | None = None
        if settings.final_state == PRE_NORM:
            heads = [m for m in self.runner.model.modules() if isinstance(m, _StatesOnlyHead)]
            self.final_norm = _tap_final_norm(self.runner.model, heads)
        self._cpu_group = None
        if self.tp_size > 1:
            from sglang.srt.distributed.parallel_state import get_world_group  # optional: sglang

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
        # optional dependency: sglang
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams  # optional dep: sglang

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
        # optional dependency: sglang
        from sglang.bench_one_batch import TreeCacheNamespace, _maybe_prepare_mlp_sync_batch
        from sglang.srt.managers.schedule_batch import ScheduleBatch  # optional dep: sglang
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch  # optional dep
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # optional dep: sglang

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
