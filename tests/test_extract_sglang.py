"""extract.backend=sglang without a GPU: the real backend, store and sharding code, with the
SGLang rank replaced by a stand-in that runs a real (tiny, random-weight) Llama through
transformers and captures the states the way SGLang does (capture id = output-of-layer + 1 =
input of the next layer). The `cuda` test runs the real SGLang engine (tools/gpu_check.sh).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kimi_pipe.errors import ConfigError
from kimi_pipe.extraction import sglang
from kimi_pipe.extraction import sharding as xs
from kimi_pipe.extraction.layers import (
    capture_to_output_ids,
    output_to_capture_ids,
    resolve_output_ids,
    validate_output_ids,
)
from kimi_pipe.extraction.sglang import EngineSettings
from kimi_pipe.stages.jobs.extract import extract_job
from kimi_pipe.store.hidden_store import HiddenStore

REPO = Path(__file__).resolve().parent.parent


def run_extract(cfg: Any, rank_factory: Any = None) -> dict[str, Any]:
    """SGLang's extract stage on a composed config, through the stage's door."""
    return sglang.run_extract(extract_job(cfg), rank_factory)


def engine_settings(cfg: Any) -> EngineSettings:
    return EngineSettings.from_job(extract_job(cfg))


TINY_LAYERS = 8  # default EAGLE-3 rule gives distinct ids [1, 3, 4]
VOCAB = 128


# --- the stand-in rank ----------------------------------------------------------------------
class StandInRank:
    """Same interface as the SGLang rank. Knobs ride in `extract.server_args`:
    standin_nan_token (NaN states for sequences holding it), standin_oom_above (raise OOM when
    a batch has more tokens), standin_oom_rank (which rank raises it), standin_fail_after
    (RuntimeError after that many forwards: a crash)."""

    forwards = 0  # forwards (batches) run in this process (all instances)
    logit_calls: list[tuple[int, list[int]]] = []  # (prefix, continuation lengths) per step
    sequences = 0  # sequences forwarded in this process (all instances)

    def __init__(self, settings: EngineSettings, tp_rank: int, nccl_port: int) -> None:
        from transformers import AutoModel

        self.tp_rank = tp_rank
        self.knobs = dict(settings.server_args)
        model = AutoModel.from_pretrained(settings.model_path, dtype=torch.float32).eval()
        # The text decoder (itself for a plain model; a wrapper's, e.g. Kimi K2.5's DeepSeek-V3).
        self.model = model.get_decoder()
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.hidden_size = int(self.model.config.hidden_size)
        self.max_total_tokens = int(self.knobs.get("standin_pool_tokens", 10_000))
        self.max_requests = 64
        self.path = settings.model_path
        self.lm: Any = None
        self.capture: list[int] = []
        self.count = 0
        # extract.final_state=pre_norm: the final norm's input, as the SGLang rank's hook keeps.
        self.final_norm: dict[str, Any] | None = None
        self._pre_norm: list[torch.Tensor] = []
        if settings.final_state == "pre_norm":
            from kimi_pipe.store.conventions import final_norm_spec

            norm = self.model.norm
            self.final_norm = final_norm_spec(norm.weight, norm.variance_epsilon, "norm")
            norm.register_forward_pre_hook(lambda _m, args: self._pre_norm.append(args[0]))

    def set_layers(self, output_ids: Sequence[int]) -> list[int]:
        self.capture = [i + 1 for i in output_ids]  # SGLang's rule: input of the next layer
        return list(self.capture)

    @torch.inference_mode()
    def forward(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.count += 1
        StandInRank.forwards += 1
        StandInRank.sequences += len(batch)
        fail_after = self.knobs.get("standin_fail_after")
        if fail_after is not None and self.count > fail_after:
            raise RuntimeError("stand-in engine crashed")
        limit = self.knobs.get("standin_oom_above")
        oom_rank = self.knobs.get("standin_oom_rank", 0)
        if limit is not None and self.tp_rank == oom_rank and sum(map(len, batch)) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        aux_rows, final_rows = [], []
        for seq in batch:
            out = self.model(torch.tensor([seq]), output_hidden_states=True)
            # hidden_states[c] is the input of layer c: what SGLang captures for id c.
            aux = torch.cat([out.hidden_states[c][0] for c in self.capture], dim=-1)
            final = out.last_hidden_state[0] if self.final_norm is None else self._pre_norm.pop()[0]
            if self.knobs.get("standin_nan_token") in seq:
                aux = aux.clone()
                aux[0, 0] = float("nan")
            aux_rows.append(aux)
            final_rows.append(final)
        if self.tp_rank != 0:
            return None
        return torch.cat(aux_rows), torch.cat(final_rows)

    @torch.inference_mode()
    def logits(
        self, prefix: list[int], continuations: list[list[int]], rows: list[list[int]]
    ) -> list[torch.Tensor] | None:
        """The engine's logits of the rows asked for: here a plain forward per continuation
        over prefix + continuation, no cache (the reference the scorers' arrangement of
        prefix and rows must reproduce)."""
        from kimi_pipe.extraction.hf_backend import load_text_model

        StandInRank.logit_calls.append((len(prefix), [len(c) for c in continuations]))
        if self.lm is None:
            self.lm = load_text_model(self.path, "float32").eval()
        out = []
        for cont, want in zip(continuations, rows, strict=True):
            logits = self.lm(torch.tensor([prefix + cont])).logits[0, len(prefix) :]
            out.append(logits[want].float())
        return out if self.tp_rank == 0 else None

    def close(self) -> None:
        self.model = None


# --- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _records(path: Path, n: int = 14, seed: int = 1, poison: int | None = None) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 20))]
        output = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        if poison is not None:
            prompt = [t if t != poison else poison + 1 for t in prompt]
            output = [t if t != poison else poison + 1 for t in output]
        rows.append(
            {
                "id": f"s{i:03d}",
                "ok": True,
                "issues": [],
                "prompt_ids": prompt,
                "output_ids": output,
                "loss_mask": [0] * len(prompt) + [1] * len(output),
            }
        )
    rows.append({"id": "bad", "ok": False, "issues": ["x"], "prompt_ids": [], "output_ids": []})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows[:-1]


def _cfg(records: Path, model: Path, out: Path, *extra: str) -> Any:
    from kimi_pipe.config import compose

    return compose(
        [
            "extract=sglang",
            f"extract.records={records}",
            f"extract.model_path={model}",
            f"extract.output_dir={out}",
            "extract.dtype=float32",
            "extract.batch_tokens=60",
            "extract.shard_samples=3",
            *extra,
        ]
    )


_REFERENCE: dict[Path, StandInRank] = {}


def _reference(model: Path) -> StandInRank:
    """The stand-in run directly, one sequence at a time: what the store must hold."""
    if model not in _REFERENCE:
        rank = StandInRank(EngineSettings(model_path=str(model)), 0, 0)
        rank.set_layers([1, 3, 4])
        _REFERENCE[model] = rank
    return _REFERENCE[model]


def _ids(rec: dict) -> list[int]:
    return rec["prompt_ids"] + rec["output_ids"]


# --- layer ids ------------------------------------------------------------------------------
def test_layer_mapping_states_sglang_capture_ids_once() -> None:
    kimi = resolve_output_ids(None, 61)
    assert kimi == [1, 29, 57]
    assert output_to_capture_ids(kimi) == [2, 30, 58]
    assert capture_to_output_ids(output_to_capture_ids(kimi)) == kimi
    assert resolve_output_ids(None, 61, {"eagle3": {"layer_ids": [2, 30, 56]}}) == [2, 30, 56]
    assert resolve_output_ids([3, 4], 61, {"eagle3": {"layer_ids": [2, 30, 56]}}) == [3, 4]
    with pytest.raises(ValueError, match="out of range"):
        validate_output_ids([1, 29, 60], 61)  # layer 60's output is the final state
    with pytest.raises(ValueError, match="ascending"):
        validate_output_ids([29, 1], 61)


# --- sharding and batching ------------------------------------------------------------------
def test_shards_partition_ids_stably_across_processes() -> None:
    ids = [f"id-{i}" for i in range(1000)]
    parts = [xs.select_shard(ids, k, 4, key=str) for k in range(4)]
    assert sorted(sum(parts, [])) == sorted(ids)
    assert all(150 < len(p) < 350 for p in parts)  # a hash, not a range split
    assert xs.select_shard(list(reversed(ids)), 2, 4, key=str) == list(reversed(parts[2]))
    code = (
        "from kimi_pipe.extraction.sharding import shard_of;"
        "print([shard_of(f'id-{i}', 4) for i in range(1000)])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [xs.shard_of(i, 4) for i in ids]
    with pytest.raises(ValueError, match="extract.shard"):
        xs.select_shard(ids, 4, 4, key=str)


def test_next_batch_packed_and_padded_costs() -> None:
    from collections import deque

    lengths = [10, 10, 10, 4, 4, 4, 4]
    packed = deque(lengths)
    budget = xs.TokenBudget(25)
    got = []
    while packed:
        got.append(xs.next_batch(packed, budget, lambda n: n))
    assert got == [[10, 10], [10, 4, 4, 4], [4]]
    padded = deque([10, 4, 4, 4, 4])
    assert xs.next_batch(padded, xs.TokenBudget(25), lambda n: n, padded=True) == [10, 4]
    alone = deque([100, 1])
    assert xs.next_batch(alone, xs.TokenBudget(25), lambda n: n) == [100]


def test_engine_settings_pin_capture_flags() -> None:
    s = EngineSettings(model_path="/m", tp_size=8, ep_size=8, mem_fraction_static=0.8)
    kw = s.server_args_kwargs(nccl_port=1234)
    assert kw["disable_radix_cache"] is True
    assert kw["chunked_prefill_size"] == -1
    assert kw["skip_tokenizer_init"] is True
    assert kw["disable_cuda_graph"] is True
    assert (kw["tp_size"], kw["ep_size"], kw["mem_fraction_static"]) == (8, 8, 0.8)
    with pytest.raises(ValueError, match="dp_size"):
        EngineSettings(model_path="/m", dp_size=2)
    with pytest.raises(ValueError, match="radix"):
        EngineSettings(model_path="/m", disable_radix_cache=False)
    with pytest.raises(ValueError, match="ep_size"):
        EngineSettings(model_path="/m", tp_size=8, ep_size=3)


def test_device_reaches_sglang_and_sizes_the_cpu_pool(tmp_path: Path) -> None:
    cuda = engine_settings(_cfg(tmp_path / "r.jsonl", tmp_path, tmp_path / "o"))
    kw = cuda.server_args_kwargs(nccl_port=1)
    assert (cuda.device, kw["device"]) == ("cuda", "cuda")
    assert "max_total_tokens" not in kw  # the GPU pool is sized by mem_fraction_static
    cpu = engine_settings(
        _cfg(tmp_path / "r.jsonl", tmp_path, tmp_path / "o", "extract.device=cpu")
    )
    kw = cpu.server_args_kwargs(nccl_port=1)
    # On CPU the pool holds one batch, not a fraction of the host's shared memory.
    assert (kw["device"], kw["max_total_tokens"], cpu.base_gpu_id) == ("cpu", 60, 0)
    set_pool = engine_settings(
        _cfg(
            tmp_path / "r.jsonl",
            tmp_path,
            tmp_path / "o",
            "extract.device=cpu",
            "extract.max_total_tokens=500",
        )
    )
    assert set_pool.server_args_kwargs(nccl_port=1)["max_total_tokens"] == 500
    with pytest.raises(ValueError, match="extract.device"):
        EngineSettings(model_path="/m", device="tpu")


def test_heads_held_by_the_model_itself_are_replaced() -> None:
    """SGLang's LlamaForCausalLM holds its LogitsProcessor as `model.logits_processor` (found
    when the backend first ran, on SGLang's CPU engine): top-level and nested heads are both
    replaced; a model that is itself a head is refused."""
    from kimi_pipe.extraction.sglang.runner import _replace_heads, _StatesOnlyHead

    class Head(torch.nn.Module):
        pass

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = Head()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.logits_processor = Head()
            self.inner = Inner()

    model = Model()
    assert sorted(_replace_heads(model, Head)) == ["inner.head", "logits_processor"]
    assert isinstance(model.logits_processor, _StatesOnlyHead)
    assert isinstance(model.inner.head, _StatesOnlyHead)
    with pytest.raises(RuntimeError, match="no SGLang LogitsProcessor"):
        _replace_heads(Model(), torch.nn.Linear)
    with pytest.raises(RuntimeError, match="itself"):
        _replace_heads(Head(), Head)


class _FusedRMSNorm(torch.nn.Module):
    """SGLang's RMSNorm as its fused CPU/CUDA kernels run it: `norm(x, residual)` writes
    x + residual into residual and the normed rows into x, in place. `one_plus`: a Gemma-style
    (1 + weight) norm, which the stored formula cannot recompute."""

    def __init__(self, width: int, one_plus: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.variance_epsilon = 1e-5
        self.one_plus = one_plus

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is not None:
            residual.add_(x)
            x.copy_(residual)
        w = 1 + self.weight if self.one_plus else self.weight
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * w
        x.copy_(normed)
        return x if residual is None else (x, residual)


class _TextModel(torch.nn.Module):
    def __init__(self, width: int, one_plus: bool = False) -> None:
        super().__init__()
        self.layers_to_capture: list[int] = []
        self.norm = _FusedRMSNorm(width, one_plus)


class _Wrapper(torch.nn.Module):  # Kimi K2.5's shape: language_model.model holds the norm
    def __init__(self, width: int, one_plus: bool = False) -> None:
        super().__init__()
        self.language_model = torch.nn.Module()
        self.language_model.model = _TextModel(width, one_plus)


@torch.no_grad()
def test_pre_norm_tap_keeps_the_norm_input_a_fused_kernel_overwrites() -> None:
    """extract.final_state=pre_norm on the SGLang rank: the hook on the capturing text model's
    norm keeps x + residual (or x) before the fused kernel overwrites both in place; the head
    returns it instead of the post-norm rows; the manifest entry names the norm and recomputes
    the post-norm rows the module returned."""
    from kimi_pipe.extraction.sglang.runner import _Captured, _StatesOnlyHead, _tap_final_norm
    from kimi_pipe.store.conventions import rms_norm

    model, head = _Wrapper(8), _StatesOnlyHead()
    spec = _tap_final_norm(model, [head])
    norm = model.language_model.model.norm
    assert spec["module"] == "language_model.model.norm" and spec["eps"] == 1e-5
    assert spec["weight"] == norm.weight.tolist()
    x, res = torch.randn(5, 8), torch.randn(5, 8)
    want = x + res
    post, _ = norm(x, res)
    got = head(None, post, None, None, aux_hidden_states=[torch.zeros(5, 24)])
    assert isinstance(got, _Captured) and torch.equal(got.final, want)
    assert torch.allclose(rms_norm(got.final, spec), post, atol=1e-6)  # export's recompute
    x = torch.randn(3, 8)
    want = x.clone()
    post = norm(x)  # no residual (a model whose first layer's residual is None)
    assert torch.equal(head(None, post, None, None, aux_hidden_states=[post]).final, want)
    with pytest.raises(RuntimeError, match="did not run"):  # taken once per forward
        head(None, post, None, None, aux_hidden_states=[post])
    norm(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="not one full row per token"):
        head(None, torch.zeros(3, 4), None, None, aux_hidden_states=[post])


def test_pre_norm_tap_refuses_a_norm_it_cannot_store() -> None:
    from kimi_pipe.extraction.sglang.runner import _tap_final_norm

    with pytest.raises(RuntimeError, match="rsqrt"):  # (1 + weight): export would be wrong
        _tap_final_norm(_Wrapper(8, one_plus=True), [])
    two = torch.nn.Module()
    two.a, two.b = _TextModel(8), _TextModel(8)
    with pytest.raises(RuntimeError, match="expected one text model"):
        _tap_final_norm(two, [])
    with pytest.raises(ConfigError, match="final_state"):
        EngineSettings(model_path="m", final_state="prenorm")


def test_cpu_engine_switch_is_checked_against_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang picks CPU or CUDA once, at import, from SGLANG_USE_CPU_ENGINE: a device that
    disagrees with it is an error, never a silent run on the other device."""
    from kimi_pipe.extraction.sglang.runner import CPU_ENGINE_ENV, _import_sglang

    monkeypatch.setenv(CPU_ENGINE_ENV, "1")
    with pytest.raises(RuntimeError, match="extract.device=cuda"):
        _import_sglang("cuda")
    monkeypatch.delenv(CPU_ENGINE_ENV)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.common", object())  # imported already
    with pytest.raises(RuntimeError, match="before SGLANG_USE_CPU_ENGINE=1"):
        _import_sglang("cpu")


def test_missing_engine_and_model_give_clear_errors(tmp_path: Path) -> None:
    from kimi_pipe.extraction.sglang import open_backend
    from kimi_pipe.extraction.sglang.runner import _RankRunner

    try:
        import sglang  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install '\.\[sglang\]'"):
            _RankRunner(EngineSettings(model_path=str(tmp_path)), 0, 0)
    cfg = _cfg(tmp_path / "r.jsonl", tmp_path / "no-such-model", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        open_backend(extract_job(cfg))


# --- _RankRunner logic without SGLang (no GPU): set_layers and the ranks' agreement --------
def _bare_runner(tp_rank: int = 0, group: object | None = None) -> Any:
    from types import SimpleNamespace

    from kimi_pipe.extraction.sglang.runner import _RankRunner

    pools = SimpleNamespace(clear=lambda: None)
    runner = object.__new__(_RankRunner)  # skip __init__: it needs SGLang and a GPU
    runner.runner = SimpleNamespace(req_to_token_pool=pools, token_to_kv_pool_allocator=pools)
    runner.tp_rank, runner._cpu_group = tp_rank, group
    return runner


def test_rank_override_of_sglang_capture_ids_is_loud_and_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    class Model(torch.nn.Module):
        def set_eagle3_layers_to_capture(self, ids: list[int]) -> None:
            self.layers_to_capture = list(ids)  # a model that does not add 1

    runner = _bare_runner()
    runner.runner = SimpleNamespace(model=Model())
    with caplog.at_level("WARNING", logger="kimi_pipe.extraction.sglang.runner"):
        assert runner.set_layers([2, 30, 56]) == [3, 31, 57]
    assert runner.overridden_capture_ids == [2, 30, 56]
    (rec,) = [r for r in caplog.records if "capture ids" in r.getMessage()]
    assert rec.levelname == "WARNING"
    assert "[2, 30, 56]" in rec.getMessage() and "[3, 31, 57]" in rec.getMessage()


@pytest.mark.parametrize(
    ("own", "peer", "expected"),
    [
        (ValueError("boom"), 0, ValueError),  # own error: re-raised after the all-reduce
        (None, 2, RuntimeError),  # a peer failed: this rank fails too instead of hanging
        (None, 1, torch.OutOfMemoryError),  # a peer ran out of memory: all retry
        (torch.OutOfMemoryError("oom"), 2, RuntimeError),  # an error beats an OOM
    ],
)
def test_rank_forward_always_reaches_the_all_reduce(
    monkeypatch: pytest.MonkeyPatch, own: Exception | None, peer: int, expected: type
) -> None:
    import torch.distributed as dist

    from kimi_pipe.extraction.sglang.runner import _Captured

    sent: list[int] = []

    def all_reduce(flag: torch.Tensor, op: Any = None, group: Any = None) -> None:
        sent.append(int(flag.item()))
        flag.fill_(max(int(flag.item()), peer))  # MAX with the other rank's status

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner = _bare_runner(tp_rank=1, group=object())

    def extend(batch: list[list[int]]) -> _Captured:
        if own is not None:
            raise own
        return _Captured(torch.zeros(2, 3), torch.zeros(2, 1))

    runner._extend = extend
    with pytest.raises(expected) as raised:
        runner.forward([[1, 2]])
    assert type(raised.value) is expected  # OutOfMemoryError is a RuntimeError too
    assert sent == [0 if own is None else (1 if isinstance(own, torch.OutOfMemoryError) else 2)]


# --- the stage with the stand-in engine -----------------------------------------------------
def test_store_matches_hf_backend_per_layer(tmp_path: Path, tiny_model: Path) -> None:
    from kimi_pipe.extraction.hf_backend import HFBackend

    recs = _records(tmp_path / "records.jsonl")
    out = tmp_path / "store"
    summary = run_extract(_cfg(tmp_path / "records.jsonl", tiny_model, out), StandInRank)
    assert summary["capture"]["written"] == len(recs)
    assert summary["capture"]["batches"] > 1
    store = HiddenStore(out)
    assert store.manifest["layer_ids"] == [1, 3, 4]
    assert store.manifest["sglang_capture_ids"] == [2, 4, 5]
    assert store.manifest["layer_convention"] == "output_of_layer"
    assert sorted(store.ids) == [r["id"] for r in recs]
    hf = HFBackend(tiny_model, dtype="float32", layer_ids=[1, 3, 4])
    for rec in recs:
        got = store[rec["id"]]
        assert got["input_ids"].tolist() == _ids(rec)
        assert got["loss_mask"].tolist() == rec["loss_mask"]
        aux_ref, final_ref = hf.forward([_ids(rec)])[0]
        h = store.manifest["hidden_size"]
        for k in range(3):  # per captured layer
            diff = (
                (
                    got["aux_hidden_state"][:, k * h : (k + 1) * h].float()
                    - aux_ref[:, k * h : (k + 1) * h]
                )
                .abs()
                .max()
            )
            assert diff < 1e-5, (rec["id"], k, float(diff))  # both float32
        assert (got["hidden_state"].float() - final_ref).abs().max() < 1e-5


def test_pre_norm_store_from_the_engine_serves_speculators(
    tmp_path: Path, tiny_model: Path
) -> None:
    """extract=sglang extract.final_state=pre_norm: the manifest says pre_norm with the rank's
    final_norm, the states are hf's pre-norm states, and speculators (pre-norm) exports every
    sample; a rank that gives no final_norm is refused at open."""
    from kimi_pipe.exporters import INDEX_FILE, export
    from kimi_pipe.extraction.hf_backend import HFBackend

    recs = _records(tmp_path / "records.jsonl", n=5)
    out = tmp_path / "store"
    cfg = _cfg(tmp_path / "records.jsonl", tiny_model, out, "extract.final_state=pre_norm")
    summary = run_extract(cfg, StandInRank)
    assert summary["capture"]["written"] == len(recs)
    store = HiddenStore(out)
    assert store.manifest["final_state"] == "pre_norm"
    assert store.manifest["final_norm"]["module"] == "norm"
    hf = HFBackend(tiny_model, dtype="float32", layer_ids=[1, 3, 4], final_state="pre_norm")
    assert (
        store.manifest["final_norm"]["weight"] == hf.store_fields["extra"]["final_norm"]["weight"]
    )
    for rec in recs:
        _, final_ref = hf.forward([_ids(rec)])[0]
        assert (store[rec["id"]]["hidden_state"].float() - final_ref).abs().max() < 1e-5
    export([out], tmp_path / "speculators", "speculators")
    index = (tmp_path / "speculators" / INDEX_FILE).read_text().splitlines()
    assert len(index) == len(recs)

    class NoNorm(StandInRank):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.final_norm = None

    with pytest.raises(RuntimeError, match="gave no final_norm"):
        run_extract(
            _cfg(
                tmp_path / "records.jsonl",
                tiny_model,
                tmp_path / "s2",
                "extract.final_state=pre_norm",
            ),
            NoNorm,
        )


def test_crash_then_resume_stores_every_id_once(tmp_path: Path, tiny_model: Path) -> None:
    recs = _records(tmp_path / "records.jsonl", n=12)
    out = tmp_path / "store"
    crashing = _cfg(
        tmp_path / "records.jsonl", tiny_model, out, "+extract.server_args.standin_fail_after=3"
    )
    with pytest.raises(RuntimeError, match="crashed"):
        run_extract(crashing, StandInRank)
    part = HiddenStore(out)
    assert 0 < len(part) < len(recs)  # committed shards survived the crash
    (out / "shards" / "shard_99999.safetensors.tmp").write_bytes(b"torn")  # half-written shard
    before = StandInRank.sequences
    summary = run_extract(_cfg(tmp_path / "records.jsonl", tiny_model, out), StandInRank)
    assert summary["capture"]["skipped_done"] == len(part)
    # no redo: exactly the samples the crash left out are forwarded (once each, no OOM here)
    assert StandInRank.sequences - before == summary["capture"]["samples_in"] - len(part)
    store = HiddenStore(out)
    lines = (out / "index.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert sorted(ids) == [r["id"] for r in recs]  # each id exactly once
    ref = _reference(tiny_model)
    for rec in recs:
        aux, final = ref.forward([_ids(rec)])
        got = store[rec["id"]]
        assert got["aux_hidden_state"].dtype == torch.float32  # extract.dtype, store_dtype null
        assert torch.equal(got["aux_hidden_state"], aux)
        assert torch.equal(got["hidden_state"], final)


def test_nonfinite_states_are_marked_not_written(tmp_path: Path, tiny_model: Path) -> None:
    recs = _records(tmp_path / "records.jsonl", poison=7)
    poisoned = {"s001", "s004"}
    for rec in recs:
        if rec["id"] in poisoned:
            rec["output_ids"][0] = 7
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "store"
    cfg = _cfg(
        tmp_path / "records.jsonl", tiny_model, out, "+extract.server_args.standin_nan_token=7"
    )
    summary = run_extract(cfg, StandInRank)
    assert summary["capture"]["issues"] == {xs.NONFINITE: 2}
    store = HiddenStore(out)
    assert set(store.ids) == {r["id"] for r in recs} - poisoned
    logged = [json.loads(line) for line in (out / xs.ISSUES).read_text().splitlines()]
    assert {row["id"] for row in logged} == poisoned
    assert all(row["issues"] == [xs.NONFINITE] for row in logged)
    again = run_extract(cfg, StandInRank)  # resume: marked samples are not captured again
    assert again["capture"]["skipped_done"] == len(recs)
    assert again["capture"]["batches"] == 0


def test_oom_halves_batch_and_retries(tmp_path: Path, tiny_model: Path) -> None:
    recs = _records(tmp_path / "records.jsonl", n=10)
    longest = max(len(_ids(r)) for r in recs)
    out = tmp_path / "store"
    cfg = _cfg(
        tmp_path / "records.jsonl",
        tiny_model,
        out,
        "extract.batch_tokens=400",
        f"+extract.server_args.standin_oom_above={longest + 5}",
    )
    summary = run_extract(cfg, StandInRank)
    cap = summary["capture"]
    assert cap["oom_retries"] >= 1
    assert summary["final_batch_tokens"] < 400
    assert cap["written"] == len(recs)  # every sample fits alone: nothing lost
    assert sorted(HiddenStore(out).ids) == [r["id"] for r in recs]
    # A sample that does not fit even alone is reported, and the run goes on.
    out2 = tmp_path / "store2"
    cfg2 = _cfg(
        tmp_path / "records.jsonl",
        tiny_model,
        out2,
        f"+extract.server_args.standin_oom_above={longest - 1}",
    )
    summary2 = run_extract(cfg2, StandInRank)
    too_long = {r["id"] for r in recs if len(_ids(r)) > longest - 1}
    assert summary2["capture"]["issues"] == {xs.CAPTURE_OOM: len(too_long)}
    assert set(HiddenStore(out2).ids) == {r["id"] for r in recs} - too_long
    # capture_oom is not permanent: a rerun with room for them stores them.
    rerun = run_extract(_cfg(tmp_path / "records.jsonl", tiny_model, out2), StandInRank)
    assert rerun["capture"]["written"] == len(too_long)
    assert sorted(HiddenStore(out2).ids) == [r["id"] for r in recs]


def test_shards_finish_into_one_index(tmp_path: Path, tiny_model: Path) -> None:
    recs = _records(tmp_path / "records.jsonl", n=9)
    out = tmp_path / "store"
    first = run_extract(
        _cfg(
            tmp_path / "records.jsonl", tiny_model, out, "extract.shard=1", "extract.num_shards=3"
        ),
        StandInRank,
    )
    assert first["merged"] is None and not (out / "index.jsonl").exists()
    for shard in (0, 2):
        last = run_extract(
            _cfg(
                tmp_path / "records.jsonl",
                tiny_model,
                out,
                f"extract.shard={shard}",
                "extract.num_shards=3",
            ),
            StandInRank,
        )
    assert last["merged"]["samples"] == len(recs)
    store = HiddenStore(out)
    ids = [json.loads(line)["id"] for line in (out / "index.jsonl").read_text().splitlines()]
    assert sorted(ids) == [r["id"] for r in recs]
    ref = _reference(tiny_model)
    for rec in recs:
        aux, final = ref.forward([_ids(rec)])
        assert store[rec["id"]]["input_ids"].tolist() == _ids(rec)
        assert torch.equal(store[rec["id"]]["hidden_state"], final)
    from datasets import load_from_disk

    assert sorted(load_from_disk(str(out / "tokens"))["id"]) == sorted(ids)
    assert xs.merge_parts(out, 3)["samples"] == len(recs)  # idempotent rebuild
    (out / xs.MERGED_STORE).unlink()  # now it looks like a store written without shards
    with pytest.raises(RuntimeError, match="without work shards"):
        xs.merge_parts(out, 3)
    assert sorted(HiddenStore(out).ids) == sorted(ids)  # untouched


# --- merging parts: stale markers, locks, late finishers -----------------------------------
def _tiny_manifest(dtype: str) -> dict[str, Any]:
    from kimi_pipe.store.hidden_store import make_manifest

    return make_manifest(model="tiny", num_layers=8, layer_ids=[1, 3, 4], hidden_size=4,
                         dtype=dtype, loss_mask="m", source_runs=["r"], backend="test")  # fmt: skip


def _synthetic_parts(store: Path, num_shards: int, n: int = 9, done: bool = True) -> list[str]:
    """Parts of a store written straight through StoreWriter (no engine): fast."""
    from kimi_pipe.store.hidden_store import StoreWriter

    manifest = _tiny_manifest("float32")
    ids = [f"x{i}" for i in range(n)]
    for shard in range(num_shards):
        part = xs.part_dir(store, shard, num_shards)
        with StoreWriter(part, manifest, shard_samples=2) as w:
            for sid in xs.select_shard(ids, shard, num_shards, key=str):
                w.add(sid, [1, 2], [0, 1], torch.zeros(2, 12), torch.zeros(2, 4))
        if done:
            xs.mark_part_done(part, {"shard": shard})
    return ids


def test_rerun_part_is_not_done_until_it_finishes(tmp_path: Path, tiny_model: Path) -> None:
    """A part that starts again drops its old part_done.json: no merge while it runs."""
    _records(tmp_path / "records.jsonl", n=9)
    out = tmp_path / "store"

    def cfg(shard: int, *extra: str) -> Any:
        return _cfg(tmp_path / "records.jsonl", tiny_model, out, f"extract.shard={shard}",
                    "extract.num_shards=3", *extra)  # fmt: skip

    for shard in range(3):
        run_extract(cfg(shard), StandInRank)
    assert (out / xs.MERGE_DONE).exists()
    # More records, then shard 1 runs again and dies mid-way: its old marker must not count.
    _records(tmp_path / "records.jsonl", n=30)
    with pytest.raises(RuntimeError, match="crashed"):
        run_extract(cfg(1, "+extract.server_args.standin_fail_after=1"), StandInRank)
    assert xs.parts_status(out, 3)[1] == [1]
    assert run_extract(cfg(0), StandInRank)["merged"] is None  # shard 1 is still unfinished


def test_stale_merge_lock_file_does_not_block_merging(tmp_path: Path) -> None:
    ids = _synthetic_parts(tmp_path, 3)
    (tmp_path / xs.MERGE_LOCK).write_text("12345")  # left by a merge that was killed
    info = xs.maybe_merge(tmp_path, 3)
    assert info is not None and info["samples"] == len(ids)
    assert sorted(HiddenStore(tmp_path).ids) == sorted(ids)


def test_merge_waits_for_a_running_merge(tmp_path: Path) -> None:
    import fcntl
    import threading
    import time

    ids = _synthetic_parts(tmp_path, 2)
    result: dict[str, Any] = {}
    with open(tmp_path / xs.MERGE_LOCK, "a+") as held:  # another process merging
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: result.update(info=xs.maybe_merge(tmp_path, 2)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # waits instead of giving up
        fcntl.flock(held.fileno(), fcntl.LOCK_UN)
    waiter.join(timeout=60)
    assert result["info"]["samples"] == len(ids)
    # A later finisher finds the merge covering every part and keeps it.
    assert xs.maybe_merge(tmp_path, 2) == result["info"]


def test_part_finishing_during_merge_triggers_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _synthetic_parts(tmp_path, 3)
    real = xs.merge_parts
    calls: list[int] = []

    def merge_while_part_2_finishes_again(store: Any, n: int) -> dict[str, Any]:
        info = real(store, n)
        calls.append(1)
        if len(calls) == 1:  # part 2 finished again (with a new sample) during this merge
            from kimi_pipe.store.hidden_store import StoreWriter

            part = xs.part_dir(store, 2, n)
            manifest = json.loads((part / "manifest.json").read_text())
            with StoreWriter(part, manifest) as w:
                w.add("late", [1], [1], torch.zeros(1, 12), torch.zeros(1, 4))
            xs.mark_part_done(part, {"shard": 2})
        return info

    monkeypatch.setattr(xs, "merge_parts", merge_while_part_2_finishes_again)
    info = xs.maybe_merge(tmp_path, 3)
    assert len(calls) == 2
    assert info is not None and info["samples"] == len(ids) + 1
    assert "late" in HiddenStore(tmp_path)


def test_value_overflowing_store_dtype_is_marked_nonfinite(tmp_path: Path) -> None:
    """float32 1e5 is finite but becomes inf in a float16 store: marked, not written."""
    from kimi_pipe.store.hidden_store import StoreWriter

    manifest = _tiny_manifest("float16")
    samples = [xs.Sample("big", [1, 2], [0, 1]), xs.Sample("ok", [3], [1])]

    def capture(batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        outs = []
        for seq in batch:
            aux = torch.zeros(len(seq), 12)
            if seq == [1, 2]:
                aux[0, 0] = 1e5  # > 65504: inf in float16
            outs.append((aux, torch.zeros(len(seq), 4)))
        return outs

    with StoreWriter(tmp_path, manifest) as w:
        issues = xs.IssueLog(tmp_path)
        stats = xs.capture_into(capture, samples, w, issues, xs.TokenBudget(100))
    assert stats.issues == {xs.NONFINITE: 1}
    assert HiddenStore(tmp_path).ids == ["ok"]
    assert issues.ids == {"big"}


def test_tensor_parallel_ranks_agree_on_oom(tmp_path: Path, tiny_model: Path) -> None:
    """tp_size=2: rank 1 is a spawned process; its OOM makes both ranks retry the halves."""
    recs = _records(tmp_path / "records.jsonl", n=5)
    longest = max(len(_ids(r)) for r in recs)
    out = tmp_path / "store"
    cfg = _cfg(
        tmp_path / "records.jsonl",
        tiny_model,
        out,
        "extract.tp_size=2",
        "extract.batch_tokens=300",
        f"+extract.server_args.standin_oom_above={longest + 5}",
        "+extract.server_args.standin_oom_rank=1",
    )
    summary = run_extract(cfg, StandInRank)
    assert summary["capture"]["oom_retries"] >= 1
    assert sorted(HiddenStore(out).ids) == [r["id"] for r in recs]


# --- target resolution through the engine ---------------------------------------------------
def _scoring_backend(model: Path, tp_size: int = 1, pool: int = 10_000) -> Any:
    from kimi_pipe.extraction.sglang import SGLangBackend

    settings = EngineSettings(
        model_path=str(model),
        dtype="float32",
        tp_size=tp_size,
        server_args={"standin_pool_tokens": pool},
    )
    return SGLangBackend(settings, layer_ids=[1, 3, 4], rank_factory=StandInRank)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


SAMPLINGS = [(1.0, 1.0, None), (0.7, 0.9, 20), (0.0, 1.0, None)]  # temperature, top_p, top_k


@pytest.mark.parametrize(("pool", "steps"), [(10_000, 1), (28, 2)])
def test_engine_suffix_scorer_equals_hf_scorer(
    tiny_model: Path, tiny_lm: Any, pool: int, steps: int
) -> None:
    """The engine's scorer (prefix KV once, every option extended on it) gives the hf
    scorer's log-probabilities; options that overflow the KV pool go in more steps."""
    from kimi_pipe.extraction.resolve import HFSuffixScorer, Sampling

    rng = random.Random(3)
    prefix = [rng.randrange(1, VOCAB) for _ in range(20)]
    suffixes = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (1, 4, 4, 7, 0)]
    backend = _scoring_backend(tiny_model, pool=pool)
    try:
        scorer = backend.suffix_scorer()
        assert scorer is not None
        for temperature, top_p, top_k in SAMPLINGS:
            sampling = Sampling(temperature, top_p, top_k)
            StandInRank.logit_calls.clear()
            got = scorer.score_suffixes(prefix, suffixes, sampling)
            want = HFSuffixScorer(tiny_lm, "tiny").score_suffixes(prefix, suffixes, sampling)
            assert got == pytest.approx(want, abs=1e-4)
            assert got[-1] == 0.0  # an empty suffix adds nothing
            # The prefix (less its last token, which goes with each option) once per step.
            assert len(StandInRank.logit_calls) == steps
            assert all(p == len(prefix) - 1 for p, _ in StandInRank.logit_calls)
            assert sum(sum(n) for _, n in StandInRank.logit_calls) == sum(map(len, suffixes))
        assert scorer.prefix_tokens == len(SAMPLINGS) * (len(prefix) - 1)
    finally:
        backend.close()


def test_engine_next_token_scorer_equals_hf(tiny_model: Path, tiny_lm: Any) -> None:
    """The split check's scorer through the engine (`SGLangTarget.next_token_scorer`, what
    split_check.check_record uses for an engine) gives transformers' table."""
    from kimi_pipe.extraction.resolve import Sampling
    from kimi_pipe.extraction.split_check import HFNextTokenScorer

    rng = random.Random(5)
    ids = [rng.randrange(1, VOCAB) for _ in range(30)]
    start = 12
    wanted = [[ids[start + i], rng.randrange(VOCAB)] for i in range(len(ids) - start)]
    wanted.append([rng.randrange(VOCAB) for _ in range(3)])  # the token after the end
    backend = _scoring_backend(tiny_model)
    try:
        scorer = backend.suffix_scorer()
        for temperature, top_p, top_k in SAMPLINGS:
            sampling = Sampling(temperature, top_p, top_k)
            engine = scorer.model.next_token_scorer(sampling)
            got = engine.logprobs_along(ids, start, wanted)
            want = HFNextTokenScorer(tiny_lm, sampling).logprobs_along(ids, start, wanted)
            for g, w in zip(got, want, strict=True):
                assert g == pytest.approx(w, abs=1e-4)
            assert engine.tokens == len(ids)
        with pytest.raises(ValueError, match="outside"):  # past the ids: never a wrapped row
            scorer.model.next_token_scorer(Sampling(1.0)).logprobs_along(ids, 0, [[1]])
    finally:
        backend.close()


class CharTokenizer:
    """Ids of the tiny vocabulary, one per character: enough for test_resolve's candidate set."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + ord(c) % (VOCAB - 3) for c in text]

    def convert_tokens_to_ids(self, token: str) -> int:
        return VOCAB - 1  # the end-of-turn id


def test_extract_sglang_resolves_candidates_like_hf(
    tmp_path: Path, tiny_model: Path, tiny_lm: Any
) -> None:
    """extract=sglang (tp_size=2: the follower runs the scoring steps too) resolves the closed
    candidate sets before capture, with the hf scorer's numbers, and stores the chosen ids."""
    from test_resolve import tail_record  # a stripped tail: 'restored' vs 'as returned'

    from kimi_pipe.extraction.resolve import HFSuffixScorer, ResolveSettings, score_record
    from kimi_pipe.store.records import read_records

    recs = [
        tail_record(CharTokenizer(), f"c{i}", {"temperature": t, "top_p": top_p})
        for i, (t, top_p) in enumerate(((1.0, 1.0), (1.0, 0.3), (0.7, 0.9)))
    ]
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "store"
    cfg = _cfg(
        records,
        tiny_model,
        out,
        "extract.tp_size=2",
        "resolve.min_posterior=0.6",
        "resolve.split_check=false",
    )
    summary = run_extract(cfg, StandInRank)
    after = {r["id"]: r for r in read_records(records)}
    hf = HFSuffixScorer(tiny_lm, "tiny")
    settings = ResolveSettings(min_posterior=0.6)
    for rec in recs:
        want = score_record(rec, hf, settings)
        assert want is not None
        got = after[rec["id"]]
        assert got["resolution"]["chosen"] == want["resolution"]["chosen"]
        assert got["resolution"]["posterior"] == pytest.approx(want["resolution"]["posterior"])
        assert (got["ok"], got["output_ids"]) == (want["ok"], want["output_ids"])
    resolved = [r for r in after.values() if r["ok"]]
    assert resolved and sum(summary["resolve"]["counts"].values()) == len(recs)
    # A set left unresolved keeps the ids its options share (prefix_proven, issue 33).
    cut = [r for r in after.values() if r["evidence"] == "prefix_proven"]
    store = HiddenStore(out)
    assert sorted(store.ids) == sorted(r["id"] for r in [*resolved, *cut])
    for rec in resolved:
        assert store.tokens(rec["id"])["input_ids"].tolist() == _ids(rec)
    for rec in cut:
        k = rec["candidates"]["diverge_at"]
        shared = rec["prompt_ids"] + rec["candidates"]["options"][0]["output_ids"][:k]
        assert store.tokens(rec["id"])["input_ids"].tolist() == shared


def test_hydra_multirun_over_shards_cli(tmp_path: Path, tiny_model: Path) -> None:
    """`python -m kimi_pipe extract -m extract=sglang extract.shard=0,1`: real CLI, one store."""
    recs = _records(tmp_path / "records.jsonl", n=6)
    out = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    cmd = [
        sys.executable, "-m", "kimi_pipe", "extract", "-m",
        "extract=sglang", f"extract.records={tmp_path / 'records.jsonl'}",
        f"extract.model_path={tiny_model}", f"extract.output_dir={out}",
        "extract.dtype=float32", "extract.rank_factory=test_extract_sglang:StandInRank",
        "extract.num_shards=2", "extract.shard=0,1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=shard_${extract.shard}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(HiddenStore(out).ids) == [r["id"] for r in recs]
    assert (out / xs.MERGE_DONE).exists()
    assert (tmp_path / "sweep" / "shard_0" / ".hydra").is_dir()


@pytest.mark.slow
def test_parallel_shards_with_submitit_local(tmp_path: Path, tiny_model: Path) -> None:
    """hydra/launcher=submitit_local runs the shards as parallel processes; one store."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    recs = _records(tmp_path / "records.jsonl", n=6)
    out = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    cmd = [
        sys.executable, "-m", "kimi_pipe", "extract", "-m", "hydra/launcher=submitit_local",
        "extract=sglang", f"extract.records={tmp_path / 'records.jsonl'}",
        f"extract.model_path={tiny_model}", f"extract.output_dir={out}",
        "extract.dtype=float32", "extract.rank_factory=test_extract_sglang:StandInRank",
        "extract.num_shards=2", "extract.shard=0,1", "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=shard_${extract.shard}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(HiddenStore(out).ids) == [r["id"] for r in recs]
    assert json.loads((out / xs.MERGE_DONE).read_text())["samples"] == len(recs)


def test_slurm_launcher_config_composes() -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=submitit_slurm_extract", "extract=sglang"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 8 and launcher.tasks_per_node == 1
    assert cfg.extract.backend == "sglang"


# --- real GPU -------------------------------------------------------------------------------
@pytest.mark.cuda
def test_real_sglang_matches_hf_on_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run tools/gpu_check.sh on a GPU machine)")
    pytest.importorskip("sglang", reason="needs pip install '.[sglang]'")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kimi_pipe.extraction.hf_backend import HFBackend

    # head_dim 64: the smallest the GPU attention kernels take.
    torch.manual_seed(0)
    model = tmp_path / "llama"
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model)
    recs = _records(tmp_path / "records.jsonl")
    out = tmp_path / "store"
    overrides = ["extract.dtype=bfloat16", "extract.mem_fraction_static=0.3"]
    run_extract(_cfg(tmp_path / "records.jsonl", model, out, *overrides))
    store = HiddenStore(out)
    assert store.manifest["sglang_capture_ids"] == [2, 4, 5]
    hf = HFBackend(model, dtype="bfloat16", device="cuda", layer_ids=[1, 3, 4])
    h = store.manifest["hidden_size"]
    for rec in recs:
        got = store[rec["id"]]
        aux_ref, final_ref = hf.forward([_ids(rec)])[0]
        pairs = [(got["aux_hidden_state"][:, k * h : (k + 1) * h], aux_ref[:, k * h : (k + 1) * h])
                 for k in range(3)] + [(got["hidden_state"], final_ref)]  # fmt: skip
        for k, (a, b) in enumerate(pairs):
            a, b = a.float(), b.float()
            rel = float((a - b).norm() / b.norm())
            assert rel < 2e-2, (rec["id"], k, rel)  # bf16 kernels differ, layers agree
