"""The `sglang_cpu` tier: SGLang 0.5.14's real engine on this machine's CPU, through the
project's own capture code (`extract=sglang extract.device=cpu`, the same `_RankRunner` a GPU
runs), against `extract=hf` on the demo's records; and the same engine under the executors
(docs/distributed.md): two Ray actors with one killed mid-run, one tp-2 engine over two nodes
(two Ray actors, two submitit tasks), and that engine losing a node.

Runs in the venv of `make sglang-cpu` (`make test-sglang-cpu` runs this file there, after
`make demo` made the records and the SmolLM2 weights). In any other venv it skips with the
reason. Figures (parity per layer, tokens/s of both backends measured in the same run) are
printed and written to runs/sglang_cpu/ (SGLANG_CPU_OUT).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
HAVE_SGLANG = all(importlib.util.find_spec(m) for m in ("sglang", "sgl_kernel"))
# Set by `make test-sglang-cpu`: the tier is expected to run, so a missing piece is a failure.
EXPECTED = os.environ.get("KIMI_PIPE_SGLANG_CPU") == "1"
NEEDS_VENV = "needs the SGLang CPU venv: `make sglang-cpu`, then `make test-sglang-cpu`"
if EXPECTED and not HAVE_SGLANG:
    raise RuntimeError(f"KIMI_PIPE_SGLANG_CPU=1 but sglang/sgl_kernel do not import: {NEEDS_VENV}")

pytestmark = [
    pytest.mark.sglang_cpu,
    pytest.mark.skipif(not HAVE_SGLANG, reason=NEEDS_VENV),
]

RECORDS = Path(os.environ.get("SGLANG_CPU_RECORDS", REPO / "runs/demo/records.jsonl"))
OUT = Path(os.environ.get("SGLANG_CPU_OUT", REPO / "runs/sglang_cpu"))
MAX_LEN = 4096  # the hf backend's default cap: both runs see the same tokens


def _demo_model() -> Path:
    from kimi_pipe.config import compose

    path = Path(str(compose(["model=smollm2"]).model.hf_weights))
    if not (path / "config.json").exists():
        pytest.fail(f"{path} missing: run `make demo` first (it converts SmolLM2 once)")
    return path


def _extract(
    backend: str,
    store: Path,
    model: Path,
    *extra: str,
    records: Path = RECORDS,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One extract stage through the real CLI; returns its summary plus the wall time."""
    cmd = [
        sys.executable,
        "-m",
        "kimi_pipe",
        "extract",
        f"extract={backend}",
        "model=smollm2",
        f"extract.records={records}",
        "extract.only_ok=false",  # as the demo: cut answers keep exact ids
        f"extract.model_path={model}",
        f"extract.output_dir={store}",
        f"extract.max_len={MAX_LEN}",
        "extract.batch_tokens=4096",
        f"hydra.run.dir={store.parent}/hydra-{backend}",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    (store.parent / f"{backend}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"extract={backend} failed:\n{proc.stderr[-4000:]}"
    summary = json.loads((store / "extract_summary.json").read_text())
    summary["wall_s"] = wall
    return summary


def against_hf(store: Path) -> Any:
    """The parity report of `store` against hf in float32 on the demo's records, the
    tolerance measured from hf's own bf16 run (both made by the `stores` fixture)."""
    from kimi_pipe.extraction.parity import compare_stores

    return compare_stores(
        OUT / "hidden_hf", store, records=RECORDS, max_len=MAX_LEN, baseline=OUT / "hidden_hf_bf16"
    )


@pytest.fixture(scope="module")
def stores() -> dict[str, Any]:
    if not RECORDS.exists():
        pytest.fail(f"{RECORDS} missing: run `make demo` first (make test-sglang-cpu does)")
    import shutil

    model = _demo_model()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    # Same tokens, same machine, one after the other: hf as the demo runs it (float32 compute)
    # into a bf16 store (parity is measured in bf16, not through the default fp8 store), then
    # SGLang's CPU engine in bf16 (what it serves) into a bf16 store.
    hf = _extract(
        "hf", OUT / "hidden_hf", model, "extract.device=cpu", "extract.store_dtype=bfloat16"
    )
    # The bf16 tolerance, measured: transformers itself computing in bf16 (parity's baseline).
    hf_bf16 = _extract(
        "hf",
        OUT / "hidden_hf_bf16",
        model,
        "extract.device=cpu",
        "extract.dtype=bfloat16",
        "extract.store_dtype=bfloat16",
    )
    sg = _extract(
        "sglang",
        OUT / "hidden_sglang",
        model,
        "extract.device=cpu",
        "extract.dtype=bfloat16",
        "extract.store_dtype=bfloat16",
    )
    return {"model": model, "hf": hf, "hf_bf16": hf_bf16, "sglang": sg}


def test_sglang_cpu_states_match_hf_on_every_demo_token_and_layer(
    stores: dict[str, Any],
) -> None:
    from kimi_pipe.extraction.token_samples import read_token_records

    report = against_hf(OUT / "hidden_sglang")
    (OUT / "parity.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    print("\n" + report.table())
    samples, _ = read_token_records(RECORDS, only_ok=False)
    assert report.compared == len(samples) > 0  # every demo sample, none dropped
    assert report.samples_candidate == len(samples)
    # SGLang's capture ids are the "output of layer" ids + 1, as the manifest states.
    assert report.capture_ids == [i + 1 for i in report.layer_ids]
    assert not report.problems, report.problems[:5]  # ids, loss masks, layer ids exact
    assert report.ok, report.table()


def test_sglang_cpu_manifest_names_the_engine_and_device(stores: dict[str, Any]) -> None:
    from kimi_pipe.store.hidden_store import HiddenStore

    manifest = HiddenStore(OUT / "hidden_sglang").manifest  # the backend's extras sit at the top
    assert manifest["engine"] == "sglang==0.5.14"
    assert manifest["device"] == "cpu"
    assert manifest["attention_backend"] in ("intel_amx", "torch_native")
    assert manifest["sglang_capture_ids"] == [i + 1 for i in manifest["layer_ids"]]
    assert manifest["layer_ids"] == HiddenStore(OUT / "hidden_hf").manifest["layer_ids"]


@pytest.fixture(scope="module")
def pre_norm_stores(stores: dict[str, Any]) -> dict[str, Any]:
    """SmolLM2 through SGLang with extract.final_state=pre_norm (the hook on the final norm's
    input), tp 1 and tp 2, on the demo's records."""
    common = (
        "extract.device=cpu", "extract.dtype=bfloat16", "extract.store_dtype=bfloat16",
        "extract.final_state=pre_norm",
    )  # fmt: skip
    model = stores["model"]
    return {
        "hidden_sglang_pre": _extract("sglang", OUT / "hidden_sglang_pre", model, *common),
        "hidden_sglang_pre_tp2": _extract(
            "sglang", OUT / "hidden_sglang_pre_tp2", model, *common, "extract.tp_size=2",
            env=_two_rank_env(),
        ),
    }  # fmt: skip


@pytest.mark.parametrize("store", ["hidden_sglang_pre", "hidden_sglang_pre_tp2"])
def test_sglang_cpu_pre_norm_store_holds_the_final_norms_input(
    stores: dict[str, Any], pre_norm_stores: dict[str, Any], store: str
) -> None:
    """The pre-norm SGLang store: Llama's `model.norm` named with its eps; every demo sample,
    parity against hf float32 on the final state, post-norm and as stored (pre-norm), and at
    tp 1 on every state (at tp 2 the aux rows are reported, as for the two-node tp-2 engine
    below: a tp-2 engine sums its partial results in another order); the post-norm state
    recomputed from it is the engine's own post-norm state (the default store, tp 1) within
    bf16 rounding (a wrong tap, e.g. hidden without residual, is off by order 1); speculators
    exports every sample, its final state the stored one."""
    import torch

    from kimi_pipe.extraction.parity import PRE_NORM_ROW, StateParity
    from kimi_pipe.store.conventions import rms_norm
    from kimi_pipe.store.hidden_store import HiddenStore
    from tests.support.export_readback import read_back_exports

    pre = HiddenStore(OUT / store)
    assert pre.manifest["final_state"] == "pre_norm"
    assert pre.manifest["final_norm"]["module"] == "model.norm"
    assert pre.manifest["final_norm"]["eps"] == pytest.approx(1e-5)
    report = against_hf(OUT / store)
    (OUT / f"parity_{store}.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    print("\n" + report.table())
    assert report.compared == report.samples_candidate == len(pre.ids) > 0
    assert report.states[-1].name == PRE_NORM_ROW
    assert not report.problems, report.problems[:5]
    checked = report.states if store == "hidden_sglang_pre" else report.states[-2:]
    assert all(s.ok for s in checked), report.table()
    if store == "hidden_sglang_pre":
        post = HiddenStore(OUT / "hidden_sglang")
        same = StateParity("post-norm from pre-norm against the engine's post-norm")
        for sid in post.ids:
            mine = rms_norm(pre[sid]["hidden_state"], pre.manifest["final_norm"])
            same.add(post[sid]["hidden_state"].float(), mine.to(torch.bfloat16).float())
        print(same.row())
        assert same.rel_l2 < 5e-3 and same.max_rel_err < 1.5e-2, same.row()
    read_back_exports(
        OUT / store, OUT / f"exports_{store}", ("speculators",), target_model_path=stores["model"]
    )


def test_sglang_cpu_speed_against_hf_same_run(stores: dict[str, Any]) -> None:
    """Measured, not asserted: the figures go to runs/sglang_cpu/speed.json and the log."""
    rows: dict[str, Any] = {}
    for name in ("hf", "hf_bf16", "sglang"):
        s = stores[name]
        tokens = s["capture"]["tokens_written"]
        rows[name] = {
            "loop_tokens_per_s": s["capture"]["tokens_per_s"],
            "wall_s": s["wall_s"],
            "tokens": tokens,
        }
    for name in ("hf", "hf_bf16"):
        rows[f"ratio_sglang_over_{name}_loop"] = (
            rows["sglang"]["loop_tokens_per_s"] / rows[name]["loop_tokens_per_s"]
        )
    (OUT / "speed.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n" + json.dumps(rows, indent=1))
    assert rows["sglang"]["loop_tokens_per_s"] > 0 and rows["hf"]["loop_tokens_per_s"] > 0


INTEROP_PY = (
    Path(os.environ.get("INTEROP_VENV", Path.home() / ".cache/kimi_pipe/interop-venv"))
    / "bin/python"
)


@pytest.mark.skipif(
    not INTEROP_PY.exists() and not EXPECTED,
    reason=f"needs the trainers' venv {INTEROP_PY}: run `make interop`",
)
def test_sglang_cpu_exports_load_in_the_trainers_own_loaders(stores: dict[str, Any]) -> None:
    """SpecForge, ModelOpt and tokens exports of the SGLang store, read by each trainer's own
    loader (tools/interop_check.py in the trainers' venv). The store is post-norm (the
    default, extract.final_state=post_norm: the states SGLang's head receives), so
    speculators, which needs pre-norm, is refused with the reason, as for any post-norm store
    (the miniature Kimi's pre-norm SGLang stores below export to it)."""
    from kimi_pipe.exporters import export
    from kimi_pipe.store.conventions import ConventionError

    store = OUT / "hidden_sglang"
    exports = OUT / "interop"
    for fmt in ("specforge", "modelopt", "tokens"):
        export([store], exports / fmt, fmt, seed=0)
    with pytest.raises(ConventionError, match="post-norm"):
        export([store], OUT / "refused-speculators", "speculators")
    proc = subprocess.run(
        [
            str(INTEROP_PY),
            "tools/interop_check.py",
            "--exports",
            str(exports),
            "--records",
            str(RECORDS),
            "--model",
            str(stores["model"]),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    (OUT / "interop.log").write_text(proc.stdout + proc.stderr)
    results = json.loads((exports / "interop.json").read_text())
    print("\n" + json.dumps(results, indent=1)[:6000])
    assert set(results) == {"specforge", "modelopt", "tokens"}
    for name, res in results.items():
        assert "error" not in res, f"{name}: the trainer's loader failed: {res['error']}"
        checks = res["checks"]
        if name == "tokens":  # ids-only format: SpecForge's and speculators' own readers
            assert res["pass"], (name, res)
            continue
        assert checks["ids"] and checks["loss_mask"], (name, res)
        if "argmax" in checks:
            # The loaders' numeric checks are written for a float32-computed store (aux values
            # equal to a float32 forward within bf16 rounding, argmax >= 99 %); SGLang computes
            # in bf16, whose agreement with hf is proven per layer by the parity test. What
            # must hold here: the teacher is post-norm (rms(h / w) = 1) and picks the demo's
            # own greedy tokens (a pre-norm state mislabelled post-norm: rms 20.8, argmax 14.5 %).
            assert checks["rms"], (name, res)
            assert res["argmax_next_token"] >= 0.95, (name, res)


# --- target resolution and the split check through SGLang ------------------------------------
QUESTIONS = [
    "What is the capital of France?",
    "Name a city in Europe and say what it is the capital of.",
    "Finish the sentence: The capital of France is",
]
SAMPLINGS = [
    {"temperature": 1.0, "top_p": 1.0},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 0.7, "top_p": 0.95, "top_k": 50},
    {"temperature": 0.0, "top_p": None},
]


def _candidate_records(model: Path) -> list[dict[str, Any]]:
    """Closed candidate sets on SmolLM2's own tokens: tests/test_resolve.py's answer whose
    stack stripped its trailing newline ('restored' vs 'as returned'), after other questions
    too, under each sampling."""
    from test_resolve import tail_record
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    out = []
    for q, question in enumerate(QUESTIONS):
        chat = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        prompt = list(tok.encode(chat, add_special_tokens=False))
        for k, sampling in enumerate(SAMPLINGS):
            rec = tail_record(tok, f"cand-{q}-{k}", sampling)
            answer_mask = rec["loss_mask"][len(rec["prompt_ids"]) :]
            rec.update(prompt_ids=prompt, loss_mask=[0] * len(prompt) + answer_mask)
            out.append(rec)
    return out


def _unchecked_demo_records() -> list[dict[str, Any]]:
    """The demo's records as reconstruction left them, before extract's split check."""
    from kimi_pipe.store.records import read_records

    out = []
    for rec in read_records(RECORDS):
        rec = dict(rec)
        rec.pop("split_check", None)
        rec["notes"] = [n for n in rec.get("notes") or [] if not n.startswith("split_")]
        out.append(rec)
    return out


# bf16 against float32 moves an option's log-probability by about 0.25 nats here (measured:
# transformers' own bf16 run against its float32 run, on these records).
BF16_LOGPROB_NOISE = 0.5


def _compare_decisions(
    hf: dict[str, dict[str, Any]], sg: dict[str, dict[str, Any]], min_posterior: float = 0.999
) -> dict[str, Any]:
    """Per record: the same outcome (ok, rung, ids, issues, notes, chosen option or split)?
    and how far apart the numbers are. An outcome may differ only at a sampler boundary that
    bf16 noise can cross, listed apart: hf's margin within that noise of the threshold's
    (log(p / (1 - p))), or an option inside the nucleus / top_k for one engine and just
    outside it for the other (the chosen option staying the same)."""
    assert hf.keys() == sg.keys()
    threshold = math.log(min_posterior / (1 - min_posterior))
    same, boundary, different, d_post, d_logp = 0, [], [], 0.0, 0.0
    for sid, a in hf.items():
        b = sg[sid]
        da = a.get("resolution") or a.get("split_check") or {}
        db = b.get("resolution") or b.get("split_check") or {}
        edge = False
        for x, y in zip(da.get("logprobs") or [], db.get("logprobs") or [], strict=True):
            if x is not None and y is not None:
                d_logp = max(d_logp, abs(x - y))
            elif (x is None) != (y is None):
                edge = True  # possible under one engine's sampler only
        if da.get("posterior") is not None and db.get("posterior") is not None:
            d_post = max(d_post, abs(da["posterior"] - db["posterior"]))
        keys = ("ok", "evidence", "output_ids", "issues", "notes")
        if all(a.get(k) == b.get(k) for k in keys) and da.get("chosen") == db.get("chosen"):
            same += 1
        elif da.get("chosen") == db.get("chosen") and (
            edge
            or (
                da.get("margin") is not None and abs(da["margin"] - threshold) <= BF16_LOGPROB_NOISE
            )
        ):
            boundary.append(sid)
        else:
            different.append(sid)
    return {
        "records": len(hf),
        "same_outcome": same,
        "differ_at_a_sampler_boundary": boundary,
        "different": different,
        "max_abs_posterior_diff": d_post,
        "max_abs_option_logprob_diff": d_logp,
    }


@pytest.fixture(scope="module")
def resolution_runs() -> dict[str, Any]:
    """The same records (candidate sets + the demo's, split check undone) resolved by
    extract=hf (float32, as the demo) and by extract=sglang (bfloat16: SGLang's AMX kernels
    compute in bf16/fp16 only, its rmsnorm refuses float32)."""
    from kimi_pipe.store.records import read_records

    model = _demo_model()
    root = OUT / "resolve"
    if root.exists():
        import shutil

        shutil.rmtree(root)
    root.mkdir(parents=True)
    recs = _candidate_records(model) + _unchecked_demo_records()
    runs: dict[str, Any] = {}
    for name, extra in (("hf", "extract.dtype=float32"), ("sglang", "extract.dtype=bfloat16")):
        path = root / name / "records.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        summary = _extract(
            name, path.parent / "hidden", model, "extract.device=cpu", extra, records=path
        )
        runs[name] = {
            "records": {r["id"]: r for r in read_records(path)},
            "resolve": summary["resolve"],
        }
    return runs


def test_sglang_cpu_resolution_and_split_check_equal_hf(resolution_runs: dict[str, Any]) -> None:
    """Candidate sets scored through SGLang (prefix KV once in its pool, every option extended
    on it) decide as the hf backend does, with the posteriors within bf16 noise; the split
    check runs through SGLang on the same records (its agreement with hf is reported: under
    greedy sampling a bf16 near-tie can flip an argmax)."""
    hf, sg = resolution_runs["hf"]["records"], resolution_runs["sglang"]["records"]
    cands = sorted(sid for sid in hf if sid.startswith("cand-"))
    report = {
        "candidates": _compare_decisions({k: hf[k] for k in cands}, {k: sg[k] for k in cands}),
        "split_check": _compare_decisions(
            {k: v for k, v in hf.items() if k not in cands},
            {k: v for k, v in sg.items() if k not in cands},
        ),
        "hf_counts": resolution_runs["hf"]["resolve"]["counts"],
        "sglang_counts": resolution_runs["sglang"]["resolve"]["counts"],
        "sglang_prefix_tokens": resolution_runs["sglang"]["resolve"]["prefix_tokens"],
        "sglang_suffix_tokens": resolution_runs["sglang"]["resolve"]["suffix_tokens"],
    }
    (OUT / "resolve.json").write_text(json.dumps(report, indent=1) + "\n")
    print("\n" + json.dumps(report, indent=1))
    counts = report["hf_counts"]
    assert counts.get("resolved", 0) > 0 and counts.get("split_checked", 0) > 0  # a real test
    assert report["sglang_prefix_tokens"] > 0  # scored through the engine, not skipped
    cand = report["candidates"]
    assert not cand["different"], cand["different"]
    assert cand["max_abs_option_logprob_diff"] <= BF16_LOGPROB_NOISE
    # The split check ran through SGLang on every demo record hf checked (a candidate record
    # is checked after it resolves, so those follow their resolution).
    demo = [k for k in hf if k not in cands]
    checked = {k for k in demo if hf[k].get("split_check")}
    assert checked and checked == {k for k in demo if sg[k].get("split_check")}


# --- SGLang's CPU engine in Ray actors: the unit protocol with the real engine ----------------
@contextmanager
def ray_cluster(**env: str) -> Iterator[None]:
    """A throwaway local Ray cluster (`num_cpus=2`) whose workers import this checkout, with
    `env` set for them (and restored after)."""
    import ray

    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **env,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ray_cfg(run_dir: Path, store: Path, model: Path, *extra: str) -> Any:
    """extract=sglang on CPU (bf16) under extract.executor=ray, in units of 2 samples."""
    from test_executors import make_cfg

    return make_cfg(
        [
            "extract=sglang",
            "model=smollm2",
            f"extract.run_dir={run_dir}",
            f"extract.output_dir={store}",
            "extract.only_ok=false",
            f"extract.model_path={model}",
            f"extract.max_len={MAX_LEN}",
            "extract.batch_tokens=4096",
            "extract.device=cpu",
            "extract.dtype=bfloat16",
            "extract.store_dtype=bfloat16",
            "extract.executor=ray",
            "extract.units.unit_samples=2",
            # A dead worker's unit comes back within the test; a live engine's heartbeat
            # (every lease_s / 4) survives two engines sharing 2 cores.
            "extract.units.lease_s=10",
            "extract.units.poll_s=0.3",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def ray_sglang(stores: dict[str, Any]) -> dict[str, Any]:
    """A local Ray cluster (`num_cpus=2`) with two actors, each opening SGLang's CPU engine
    (extract.executor=ray, the same UnitActor a GPU cluster runs) on the demo's records, in
    units of 2 samples; actor 0 is `ray.kill`ed (no restart) while it holds a unit, after its
    first commit. The survivor takes the unit over when its lease ends."""
    import shutil

    import ray
    from test_executors import committed_by, held_by, leases, wait_for

    from kimi_pipe.extraction.executors.ray_executor import RayPool
    from kimi_pipe.stages.jobs.extract import extract_job

    root = OUT / "ray"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    # A copy: the workers' records pass must not touch the demo's file other tests read.
    shutil.copy(RECORDS, root / "records.jsonl")
    store = root / "hidden_sglang"
    cfg = ray_cfg(root, store, stores["model"])
    with ray_cluster():
        pool = RayPool(extract_job(cfg))
        start = time.perf_counter()
        try:
            pool.add(2, ready_first=True)  # both engines open before either claims a unit
            opened = time.perf_counter() - start
            wait_for(lambda: committed_by(store, "ray0-"), 600, "a commit of actor 0")
            victim_unit = wait_for(lambda: held_by(store, "ray0-"), 300, "actor 0 to hold a unit")
            victim = max(leases(store)[victim_unit])[1]
            ray.kill(pool.actors[0], no_restart=True)
            done, errors = pool.wait()
        finally:
            pool.close()
        wall = time.perf_counter() - start
    return {
        "store": store,
        "done": done,
        "errors": errors,
        "victim": victim,
        "victim_unit": victim_unit,
        "engines_open_s": opened,
        "wall_s": wall,
    }


def test_sglang_cpu_ray_actor_killed_mid_run_every_id_once(
    ray_sglang: dict[str, Any], tmp_path: Path
) -> None:
    """Every demo sample in the export exactly once; only the unit the dead actor held was
    claimed twice; the states the two SGLang actors stored pass the same parity check as the
    one-process SGLang store (against hf in float32, tolerance from hf's own bf16 run)."""
    import torch
    from test_executors import check_exactly_once, check_in_flight, committed_by

    from kimi_pipe.extraction.parity import compare_stores
    from kimi_pipe.extraction.token_samples import read_token_records
    from kimi_pipe.store.hidden_store import HiddenStore
    from kimi_pipe.store.unit_reader import UnitHiddenStore

    store, done = ray_sglang["store"], ray_sglang["done"]
    assert len(done) == 1 and len(ray_sglang["errors"]) == 1  # the survivor finished
    assert done[0]["owner"].startswith("ray1-")
    samples, _ = read_token_records(RECORDS, only_ok=False)
    ids = [s.id for s in samples]
    committed = check_exactly_once(store, ids, tmp_path)
    in_flight = check_in_flight(store, committed, ray_sglang["victim"], ray_sglang["victim_unit"])
    assert committed_by(store, "ray0-") and committed_by(store, "ray1-")  # both engines worked
    manifest = UnitHiddenStore(store).manifest
    assert manifest["engine"] == "sglang==0.5.14" and manifest["device"] == "cpu"
    parity = against_hf(store)
    # Against the same engine run in one process (the `stores` fixture: other batches, one
    # store): within the fixed bf16 tolerance, and how many samples came out bit for bit.
    same = compare_stores(OUT / "hidden_sglang", store, records=RECORDS, max_len=MAX_LEN)
    one, ray_store = HiddenStore(OUT / "hidden_sglang"), UnitHiddenStore(store)
    bitwise = sum(
        all(torch.equal(a[k], b[k]) for k in a)
        for a, b in ((one[sid], ray_store[sid]) for sid in ids)
    )
    figures = {
        "samples": len(ids),
        "bit_identical_to_one_process": bitwise,
        "units": len(committed),
        "units_in_flight_taken_over": sorted(in_flight),
        "committed_by_actor0": len(committed_by(store, "ray0-")),
        "committed_by_actor1": len(committed_by(store, "ray1-")),
        "engines_open_s": round(ray_sglang["engines_open_s"], 1),
        "wall_s": round(ray_sglang["wall_s"], 1),
        "survivor_tokens_per_s": done[0]["capture"].get("tokens_per_s"),
        "parity_ray": parity.as_dict(),
        "against_one_process": same.as_dict(),
    }
    (OUT / "ray.json").write_text(json.dumps(figures, indent=1) + "\n")
    print("\nRay, two SGLang CPU actors:\n" + parity.table())
    assert parity.compared == len(ids)
    assert parity.ok, parity.table()
    assert same.ok and same.compared == len(ids), same.table()


# --- one SGLang engine over two nodes: Ray places its two ranks as a placement group --------
def _two_rank_env() -> dict[str, str]:
    """Two tensor-parallel ranks on this machine: each its half of the cores. SGLang asks
    for the cores of each rank whenever it has more ranks than NUMA nodes (it binds threads
    to them only with AMX), and a throwaway Ray cluster's settings."""
    half = max(1, (os.cpu_count() or 2) // 2)
    return {
        "SGLANG_CPU_OMP_THREADS_BIND": f"0-{half - 1}|{half}-{2 * half - 1}",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.fixture(scope="module")
def two_node_sglang(stores: dict[str, Any]) -> dict[str, Any]:
    """The same engine (tp 2) through the CLI: on one node, and as extract.nnodes=2 through
    each executor, the path Kimi K2.5 on 2 x 8 H100 takes: node 1 serves its rank, rank 0's
    node claims, extracts and commits every unit. Ray: the two nodes are two bundles of one
    placement group (PACK: this one machine); submitit: one job of two tasks
    (LocalExecutor: two processes here, one task per node on SLURM)."""
    import shutil

    root = OUT / "two_node"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    records = root / "records.jsonl"
    shutil.copy(RECORDS, records)  # the workers' records pass must not touch the demo's
    common = [
        "extract.device=cpu",
        "extract.dtype=bfloat16",
        "extract.store_dtype=bfloat16",
        "extract.tp_size=2",
    ]
    two_nodes = [
        "extract.nnodes=2",
        "extract.units.workers=1",
        "extract.units.unit_samples=4",
    ]
    per_executor = {
        "ray": ["extract.ray.node_strategy=PACK", "extract.ray.num_cpus=2"],
        "submitit": ["extract.submitit.timeout_min=10"],
    }
    env = _two_rank_env()
    one = root / "one_node" / "hidden"
    runs = {"one_node": _extract("sglang", one, stores["model"], *common, records=records, env=env)}
    for executor, extra in per_executor.items():
        runs[executor] = _extract(
            "sglang",
            root / executor / "hidden",
            stores["model"],
            *common,
            *two_nodes,
            f"extract.executor={executor}",
            *extra,
            records=records,
            env=env,
        )
    return {"root": root, "runs": runs}


@pytest.mark.parametrize("executor", ["ray", "submitit"])
def test_sglang_cpu_two_node_engine_stores_what_one_node_stores(
    two_node_sglang: dict[str, Any], executor: str
) -> None:
    """SGLang's own tensor parallelism (torch.distributed at the dist_init_addr the executor
    set, gloo on CPU) over two nodes: one worker claimed every unit, the other node claimed
    none, and the states equal the one-node tp-2 engine's (the same ranks, the same
    collectives)."""
    import torch

    from kimi_pipe.extraction.parity import compare_stores
    from kimi_pipe.extraction.token_samples import read_token_records
    from kimi_pipe.store.unit_reader import UnitHiddenStore, open_local_store

    root, runs = two_node_sglang["root"], two_node_sglang["runs"]
    two, store = runs[executor], root / executor / "hidden"
    assert two["complete"] and not two["worker_errors"], two
    (worker,) = two["workers"]  # one engine: rank 0's node claimed, the other node served
    samples, _ = read_token_records(root / "records.jsonl", only_ok=False)
    ids = sorted(s.id for s in samples)
    plan = UnitHiddenStore(store)
    assert sorted(worker["units_committed"]) == [u.name for u in plan.units.plan.units]
    assert sorted(plan.ids) == ids
    assert plan.manifest["engine"] == "sglang==0.5.14"
    one = open_local_store(root / "one_node" / "hidden")
    same = compare_stores(root / "one_node" / "hidden", store, records=root / "records.jsonl")
    bitwise = sum(all(torch.equal(one[i][k], plan[i][k]) for k in one[i]) for i in ids)
    # tp 2 against hf in float32, the tolerance from hf's own bf16 run (reported: a tp-2
    # engine sums its partial results in another order than tp 1).
    hf = against_hf(store)
    figures = {
        "executor": executor,
        "samples": len(ids),
        "units": len(worker["units_committed"]),
        "bit_identical_to_one_node": bitwise,
        "one_node_wall_s": round(runs["one_node"]["wall_s"], 1),
        "two_nodes_wall_s": round(two["wall_s"], 1),
        "against_one_node": same.as_dict(),
        "against_hf": hf.as_dict(),
    }
    (OUT / f"two_node_{executor}.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(f"\ntp 2 over two {executor} nodes, against hf:\n" + hf.table())
    assert same.ok and same.compared == len(ids), same.table()


def test_sglang_cpu_two_node_engine_that_loses_a_node_ends_and_a_rerun_finishes(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """Node 1's actor of a tp-2 engine over two Ray nodes is `ray.kill`ed while rank 0's
    node holds a unit: the engine's worker ends with the lost connection as its error (it
    does not hang in a collective), and the same run started again takes the unit over
    when its lease ends and commits the rest: every id once, only that unit claimed twice."""
    import shutil

    import ray
    from test_executors import (
        check_exactly_once,
        check_in_flight,
        committed_by,
        held_by,
        leases,
        wait_for,
    )

    from kimi_pipe.extraction.executors.ray_executor import RayPool
    from kimi_pipe.extraction.token_samples import read_token_records
    from kimi_pipe.stages.jobs.extract import extract_job

    shutil.copy(RECORDS, tmp_path / "records.jsonl")
    store = tmp_path / "hidden"
    cfg = ray_cfg(
        tmp_path,
        store,
        stores["model"],
        "extract.tp_size=2",
        "extract.nnodes=2",
        "extract.ray.node_strategy=PACK",
    )
    two_ranks = {k: v for k, v in _two_rank_env().items() if k.startswith("SGLANG_")}
    with ray_cluster(**two_ranks):
        pool = RayPool(extract_job(cfg))
        try:
            pool.add(1)
            wait_for(lambda: committed_by(store, "ray0-"), 600, "the engine's first commit")
            held = wait_for(lambda: held_by(store, "ray0-"), 300, "the engine to hold a unit")
            victim = max(leases(store)[held])[1]
            ray.kill(pool.nodes[0], no_restart=True)  # node 1: it serves rank 1
            killed = time.perf_counter()
            done, errors = pool.wait()
            ended_s = time.perf_counter() - killed
        finally:
            pool.close()
    assert not done and len(errors) == 1, (done, errors)
    assert "RuntimeError" in errors[0], errors  # the rank's own error, not a hang
    with ray_cluster(**two_ranks):
        pool = RayPool(extract_job(cfg))
        try:
            pool.add(1)
            again, errors_again = pool.wait()
        finally:
            pool.close()
    assert len(again) == 1 and not errors_again, errors_again
    samples, _ = read_token_records(RECORDS, only_ok=False)
    committed = check_exactly_once(store, [s.id for s in samples], tmp_path)
    in_flight = check_in_flight(store, committed, victim, held)
    figures = {
        "killed_while_holding": held,
        "worker_error": errors[0],
        "worker_ended_s_after_the_kill": round(ended_s, 2),
        "units_committed_before": len(committed) - len(again[0]["units_committed"]),
        "units_committed_by_the_rerun": len(again[0]["units_committed"]),
        "units_claimed_twice": sorted(in_flight),
    }
    (OUT / "two_node_lost.json").write_text(json.dumps(figures, indent=1) + "\n")
    print("\n" + json.dumps(figures, indent=1))


# --------------------------------------------------------------------------- the target's classes


KIMI_OUT = OUT.parent / "sglang_cpu_kimi"
KIMI_PRE_NORM = ("extract.final_state=pre_norm",)


def _kimi_extract(backend: str, store: Path, model: Path, records: Path, *extra: str,
                  env: dict[str, str] | None = None, split_check: bool = False,
                  ) -> dict[str, Any]:  # fmt: skip
    """One extract through the real CLI with Kimi K2.5's model config (its layer rule)."""
    cmd = [
        sys.executable, "-m", "kimi_pipe", "extract", f"extract={backend}", "model=kimi_k25",
        f"extract.records={records}", f"extract.model_path={model}",
        f"extract.output_dir={store}", "extract.device=cpu", "extract.store_dtype=bfloat16",
        f"resolve.split_check={str(split_check).lower()}",
        f"hydra.run.dir={store.parent}/hydra-{store.name}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    (store.parent / f"{store.name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"extract={backend} failed:\n{proc.stderr[-4000:]}"
    return json.loads((store / "extract_summary.json").read_text())


@pytest.fixture(scope="module")
def kimi_stores() -> dict[str, Any]:
    """The miniature Kimi K2.5 (docs/miniature.md) through SGLang's own Kimi K2.5 classes on
    its CPU engine (tp 1 and tp 2) and through transformers (float32 reference, bf16 baseline;
    SGLang's transformers 5.8.1 has no Kimi K2.5 class: its DeepSeek-V3 takes the text model)."""
    import random
    import shutil

    from kimi_pipe.store import miniature

    if KIMI_OUT.exists():
        shutil.rmtree(KIMI_OUT)
    KIMI_OUT.mkdir(parents=True)
    model = miniature.build(miniature.load_spec("kimi_k25"), KIMI_OUT / "model")
    rng = random.Random(41)
    rows = []
    for i in range(6):
        prompt = [163587, *(rng.randrange(163584) for _ in range(rng.randint(8, 30))), 163601]
        output = [*(rng.randrange(163584) for _ in range(rng.randint(4, 30))), 163607, 163586]
        rows.append(
            {
                "id": f"k{i}",
                "ok": True,
                "issues": [],
                "prompt_ids": prompt,
                "output_ids": output,
                "loss_mask": [0] * len(prompt) + [1] * len(output),
            }
        )
    records = KIMI_OUT / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {"model": model, "records": records, "n": len(rows)}
    out["hf"] = _kimi_extract("hf", KIMI_OUT / "hidden_hf", model, records)
    out["hf_bf16"] = _kimi_extract(
        "hf", KIMI_OUT / "hidden_hf_bf16", model, records, "extract.dtype=bfloat16"
    )
    # SGLang's stores keep the pre-norm final state (a hook on language_model.model.norm), so
    # all four exports take them; the SmolLM2 stores above keep the default post-norm one.
    out["sglang"] = _kimi_extract(
        "sglang", KIMI_OUT / "hidden_sglang", model, records, "extract.dtype=bfloat16",
        *KIMI_PRE_NORM,
    )  # fmt: skip
    out["sglang_tp2"] = _kimi_extract(
        "sglang", KIMI_OUT / "hidden_sglang_tp2", model, records, "extract.dtype=bfloat16",
        "extract.tp_size=2", *KIMI_PRE_NORM, env=_two_rank_env(),
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kimi_two_ray_nodes(kimi_stores: dict[str, Any]) -> dict[str, Any]:
    """The same tp-2 engine over two Ray nodes (extract.nnodes=2: the two ranks are two bundles
    of one placement group, PACK on this machine), the path Kimi K2.5 takes on 2 x 8 H100."""
    return _kimi_extract(
        "sglang", KIMI_OUT / "hidden_sglang_ray2", kimi_stores["model"], kimi_stores["records"],
        "extract.dtype=bfloat16", "extract.tp_size=2", "extract.nnodes=2", *KIMI_PRE_NORM,
        "extract.units.workers=1", "extract.units.unit_samples=4", "extract.executor=ray",
        "extract.ray.node_strategy=PACK", "extract.ray.num_cpus=2", env=_two_rank_env(),
    )  # fmt: skip


def test_sglang_cpu_kimi_k25_over_two_ray_nodes_stores_what_one_node_stores(
    kimi_stores: dict[str, Any], kimi_two_ray_nodes: dict[str, Any]
) -> None:
    """The miniature's tp-2 engine over two Ray nodes: every sample, bit for bit the one-node
    tp-2 store, and within hf bf16's own distance of the float32 reference."""
    import torch

    from kimi_pipe.extraction.parity import compare_stores
    from kimi_pipe.store.unit_reader import UnitHiddenStore, open_local_store

    two = kimi_two_ray_nodes
    assert two["complete"] and not two["worker_errors"], two
    plan = UnitHiddenStore(KIMI_OUT / "hidden_sglang_ray2")
    one = open_local_store(KIMI_OUT / "hidden_sglang_tp2")
    ids = sorted(plan.ids)
    assert len(ids) == kimi_stores["n"]
    assert plan.manifest["sglang_capture_ids"] == [2, 30, 58]
    bitwise = sum(all(torch.equal(one[i][k], plan[i][k]) for k in one[i]) for i in ids)
    report = compare_stores(
        KIMI_OUT / "hidden_hf", KIMI_OUT / "hidden_sglang_ray2", records=kimi_stores["records"],
        max_len=MAX_LEN, baseline=KIMI_OUT / "hidden_hf_bf16",
    )  # fmt: skip
    figures = {"samples": len(ids), "bit_identical_to_one_node_tp2": bitwise,
               "against_hf": report.as_dict()}  # fmt: skip
    (KIMI_OUT / "parity_hidden_sglang_ray2.json").write_text(json.dumps(figures, indent=1) + "\n")
    print("\nKimi K2.5 miniature, tp 2 over two Ray nodes, against hf:\n" + report.table())
    assert bitwise == len(ids)
    assert report.ok and report.compared == len(ids), report.table()


@pytest.mark.parametrize("store", ["hidden_sglang", "hidden_sglang_tp2"])
def test_sglang_cpu_runs_kimi_k25_classes_at_61_layers(
    kimi_stores: dict[str, Any], store: str
) -> None:
    from kimi_pipe.extraction.parity import compare_stores
    from kimi_pipe.store.hidden_store import HiddenStore

    manifest = HiddenStore(KIMI_OUT / store).manifest
    assert (manifest["num_layers"], manifest["layer_ids"]) == (61, [1, 29, 57])
    assert manifest["sglang_capture_ids"] == [2, 30, 58]
    # The pre-norm state of the text model's own final norm, whose weight is the checkpoint's
    # (in the engine's bf16) and whose eps is the config's.
    assert manifest["final_state"] == "pre_norm"
    norm = manifest["final_norm"]
    assert norm["module"] == "language_model.model.norm" and norm["eps"] == 1e-5
    weight = _kimi_tensor(kimi_stores["model"], "language_model.model.norm.weight")
    assert norm["weight"] == weight.bfloat16().float().tolist()
    report = compare_stores(
        KIMI_OUT / "hidden_hf", KIMI_OUT / store, records=kimi_stores["records"],
        max_len=MAX_LEN, baseline=KIMI_OUT / "hidden_hf_bf16",
    )  # fmt: skip
    (KIMI_OUT / f"parity_{store}.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    print("\n" + report.table())
    assert report.compared == report.samples_candidate == kimi_stores["n"]  # every sample
    assert report.capture_ids == [2, 30, 58]
    assert report.states[-1].name == "final state (pre-norm)"  # compared as stored, too
    assert not report.problems, report.problems[:5]
    assert report.ok, report.table()


@pytest.fixture(scope="module")
def kimi_resolution(kimi_stores: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Closed candidate sets on the miniature, each the model's own greedy continuation (hf,
    float32) against one id changed, under three samplings; resolved by hf and by SGLang."""
    import torch

    from kimi_pipe.extraction.hf_backend import HFBackend
    from kimi_pipe.store.records import read_records

    hf = HFBackend(kimi_stores["model"], final_state="pre_norm")
    base = list(read_records(kimi_stores["records"]))
    rows = []
    for i, sampling in enumerate(
        [{"temperature": 1.0}, {"temperature": 0.0}, {"temperature": 1.0, "top_k": 50}]
    ):
        prompt = base[i]["prompt_ids"]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            own = hf.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=6, min_new_tokens=6, pad_token_id=163839,
            )[0, len(prompt) :].tolist()  # fmt: skip
        other = [*own[:3], (own[3] + 1) % 163584, *own[4:]]
        options = [
            {"output_ids": other, "loss_mask": [1] * 6, "label": "other"},
            {"output_ids": own, "loss_mask": [1] * 6, "label": "own"},
        ]
        rows.append({
            "id": f"r{i}", "ok": False, "evidence": "unresolved",
            "issues": ["reasoning_tail_unverifiable"], "notes": [], "prompt_ids": prompt,
            "output_ids": other, "loss_mask": [0] * len(prompt) + [1] * 6, "sampling": sampling,
            "candidates": {"closed": True, "why_open": None, "classes": ["reasoning_tail"],
                           "diverge_at": 3, "options": options},
        })  # fmt: skip
    hf.close()
    out = {}
    for backend, extra in (("hf", ()), ("sglang", ("extract.dtype=bfloat16",))):
        run = KIMI_OUT / f"resolve_{backend}"
        run.mkdir()
        records = run / "records.jsonl"
        records.write_text("".join(json.dumps(r) + "\n" for r in rows))
        _kimi_extract(backend, run / "hidden", kimi_stores["model"], records, *extra)
        out[backend] = list(read_records(records))
    figures = {b: [r["resolution"] for r in recs] for b, recs in out.items()}
    (KIMI_OUT / "resolve.json").write_text(json.dumps(figures, indent=1) + "\n")
    return out


def test_sglang_cpu_resolves_kimi_k25_sets_like_hf(
    kimi_resolution: dict[str, list[dict[str, Any]]],
) -> None:
    """Target resolution through SGLang's Kimi K2.5 classes (the prefix's KV in its pool, the
    options extended on it: the absorbed MLA path) decides as transformers does."""
    for h, s in zip(kimi_resolution["hf"], kimi_resolution["sglang"], strict=True):
        print(h["id"], h["resolution"]["logprobs"], s["resolution"]["logprobs"])
        assert h["evidence"] == s["evidence"] == "target_resolved", (h["id"], s.get("issues"))
        assert h["resolution"]["chosen"] == s["resolution"]["chosen"] == 1  # the model's own ids
        for a, b in zip(h["resolution"]["logprobs"], s["resolution"]["logprobs"], strict=True):
            assert (a is None) == (b is None)  # an option impossible under the sampling
            if a is not None:
                assert abs(a - b) < 0.5, (h["id"], a, b)  # bf16 against float32


# The SGLang stores' exports: the miniature's tp-1 and tp-2 stores through the four EAGLE-3
# exporters, read back as tests/test_kimi_miniature.py reads the hf store's (the same helper),
# and SpecForge's and ModelOpt's own loaders where a venv holds them.
KIMI_EXPORTED = ("specforge", "speculators", "modelopt", "tokens")
SPECFORGE_PY = os.environ.get("KIMI_PIPE_SPECFORGE_PYTHON")


def _kimi_tensor(model: Path, name: str) -> Any:
    """One of the miniature's weights, float32, read from the checkpoint by its own name."""
    from safetensors import safe_open

    shard = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(model / shard), "pt") as f:
        return f.get_tensor(name).float()


def _kimi_head(model: Path) -> Any:
    """The miniature's LM head, float32."""
    return _kimi_tensor(model, "language_model.lm_head.weight")


@pytest.fixture(scope="module")
def kimi_exports(kimi_stores: dict[str, Any]) -> dict[str, Any]:
    """Each SGLang store exported and read back; the teacher (SpecForge's final state through
    Kimi's own head) against hf float32's, beside hf bf16's (the same measure of bf16)."""
    from kimi_pipe.store.conventions import rms_norm
    from kimi_pipe.store.hidden_store import HiddenStore
    from tests.support.export_readback import read_back_exports, records_by_id

    records = records_by_id(kimi_stores["records"])
    head = _kimi_head(kimi_stores["model"])
    ref = HiddenStore(KIMI_OUT / "hidden_hf")
    spec = ref.manifest["final_norm"]
    want = {i: (rms_norm(ref[i]["hidden_state"], spec) @ head.T).argmax(-1) for i in ref.ids}
    figures: dict[str, Any] = {}
    for store in ("hidden_sglang", "hidden_sglang_tp2", "hidden_hf_bf16"):
        out = KIMI_OUT / f"exports_{store}"
        start = time.perf_counter()
        # SpecForge and ModelOpt in their own folder: what tools/interop_check.py is pointed at.
        formats = KIMI_EXPORTED if store != "hidden_hf_bf16" else ("specforge",)
        trainers = tuple(f for f in formats if f in ("specforge", "modelopt"))
        teacher = read_back_exports(
            KIMI_OUT / store, out / "trainers", trainers, target_model_path=kimi_stores["model"],
            records=records,
        )  # fmt: skip
        # speculators reads the pre-norm state as stored; tokens the ids only.
        others = tuple(f for f in formats if f not in trainers)
        if others:
            read_back_exports(
                KIMI_OUT / store, out, others, target_model_path=kimi_stores["model"],
                records=records,
            )  # fmt: skip
        agree = sum(int(((teacher[i] @ head.T).argmax(-1) == want[i]).sum()) for i in teacher)
        total = sum(len(want[i]) for i in teacher)
        figures[store] = {
            "samples": len(teacher), "formats_read_back": list(formats),
            "final_state": HiddenStore(KIMI_OUT / store).manifest["final_state"],
            "teacher_argmax_equal_hf_float32": agree,
            "positions": total, "export_and_read_s": round(time.perf_counter() - start, 1),
        }  # fmt: skip
    (KIMI_OUT / "exports.json").write_text(json.dumps(figures, indent=1) + "\n")
    print("\n" + json.dumps(figures, indent=1))
    return figures


@pytest.mark.parametrize("store", ["hidden_sglang", "hidden_sglang_tp2"])
def test_sglang_cpu_kimi_k25_exports_read_back_as_the_trainers_read_them(
    kimi_stores: dict[str, Any], kimi_exports: dict[str, Any], store: str
) -> None:
    """SpecForge, speculators, ModelOpt and tokens exports of SGLang's pre-norm stores: every
    sample once, ids and masks equal the records, states equal the store (speculators' final
    state the stored pre-norm one, SpecForge's and ModelOpt's its post-norm through the stored
    norm; kimi_exports asserts these while reading); the teacher picks hf float32's token as
    often as transformers' own bf16 run does, within 2 points."""
    got, base = kimi_exports[store], kimi_exports["hidden_hf_bf16"]
    assert got["samples"] == kimi_stores["n"] and got["final_state"] == "pre_norm", got
    assert got["formats_read_back"] == list(KIMI_EXPORTED), got
    rate = got["teacher_argmax_equal_hf_float32"] / got["positions"]
    floor = base["teacher_argmax_equal_hf_float32"] / base["positions"]
    assert rate >= floor - 0.02, (got, base)


@pytest.mark.skipif(
    not SPECFORGE_PY,
    reason="SpecForge's and ModelOpt's own loaders not run: set KIMI_PIPE_SPECFORGE_PYTHON to "
    "a venv python holding specforge and nvidia-modelopt (and transformers with Kimi K2.5's "
    "classes, >= 5.24)",
)
@pytest.mark.parametrize("store", ["hidden_sglang", "hidden_sglang_tp2"])
def test_sglang_cpu_kimi_k25_exports_load_in_specforge_and_modelopt(
    kimi_stores: dict[str, Any], kimi_exports: dict[str, Any], store: str
) -> None:
    """The trainers' own readers (tools/interop_check.py: SpecForge's OfflineManifestReader,
    its EAGLE-3 normaliser and collator; ModelOpt's OfflineSupervisedDataset and collator) on
    the SGLang store's exports: every sample, ids and loss masks equal the records, the teacher
    post-norm (rms(h / w) about 1). The records are random ids, so the readers' argmax check
    (the records' own next tokens) does not apply, and their aux check is written for a
    float32-computed store (SGLang computes in bf16: its parity test measures that)."""
    exports = KIMI_OUT / f"exports_{store}" / "trainers"
    proc = subprocess.run(
        [str(SPECFORGE_PY), "-m", "tools.interop_check", "--exports", str(exports),
         "--records", str(kimi_stores["records"]), "--model", str(kimi_stores["model"])],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    (KIMI_OUT / f"interop_{store}.log").write_text(proc.stdout + proc.stderr)
    assert (exports / "interop.json").exists(), proc.stderr[-3000:]
    results = json.loads((exports / "interop.json").read_text())
    print("\n" + json.dumps(results, indent=1)[:4000])
    assert set(results) == {"specforge", "modelopt"}, results
    for name, res in results.items():
        assert "error" not in res, f"{name}: the trainer's loader failed: {res['error']}"
        assert res["samples"] == kimi_stores["n"], (name, res)
        checks = res["checks"]
        assert checks["ids"] and checks["loss_mask"] and checks["rms"], (name, res)


# The split check through SGLang's engine on the miniature: records rebuilt from the text of
# its own greedy answers, as tests/test_kimi_miniature.py checks them through hf.
@pytest.fixture(scope="module")
def kimi_split_check(kimi_stores: dict[str, Any], kimi: Any) -> dict[str, Any]:
    from kimi_pipe.core.prompt_render import prompt_ids
    from kimi_pipe.extraction.hf_backend import HFBackend
    from kimi_pipe.store.records import read_records
    from tests.support.miniature import QUESTIONS, greedy, split_check_records

    hf = HFBackend(kimi_stores["model"], final_state="pre_norm")
    answers = []
    for question in QUESTIONS[:3]:
        prompt = prompt_ids(kimi, [{"role": "user", "content": question}])
        answers.append((prompt, greedy(hf.model, prompt, 8)))
    hf.close()
    rows, truths = split_check_records(kimi, answers)
    out: dict[str, Any] = {"truths": truths, "prompts": [p for p, _ in answers]}
    for backend, extra in (("hf", ()), ("sglang", ("extract.dtype=bfloat16",))):
        run = KIMI_OUT / f"split_{backend}"
        run.mkdir()
        records = run / "records.jsonl"
        records.write_text("".join(json.dumps(r) + "\n" for r in rows))
        start = time.perf_counter()
        summary = _kimi_extract(
            backend, run / "hidden", kimi_stores["model"], records, *extra,
            "resolve.billing_splits=true", split_check=True,
        )  # fmt: skip
        out[backend] = {
            "summary": summary, "records": list(read_records(records)),
            "wall_s": round(time.perf_counter() - start, 1),
        }  # fmt: skip
    figures = {
        b: {"counts": out[b]["summary"]["resolve"]["counts"], "wall_s": out[b]["wall_s"],
            "evidence": {r["id"]: r["evidence"] for r in out[b]["records"]},
            "split_check": {r["id"]: r.get("split_check") for r in out[b]["records"]}}
        for b in ("hf", "sglang")
    }  # fmt: skip
    (KIMI_OUT / "split_check.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print("\n" + json.dumps(figures, indent=1, default=str)[:6000])
    return out


def test_sglang_cpu_kimi_k25_split_check_like_hf(kimi_split_check: dict[str, Any]) -> None:
    """Through SGLang's Kimi K2.5 classes the split check keeps the answers that re-encode to
    their own ids and recovers the one that does not, as through transformers."""
    from kimi_pipe.store.hidden_store import HiddenStore

    truths = kimi_split_check["truths"]
    assert any(not same for _, same in truths.values())  # one to recover
    for backend in ("hf", "sglang"):
        got = kimi_split_check[backend]
        counts = got["summary"]["resolve"]["counts"]
        assert sum(counts.values()) == len(truths), (backend, counts)
        store = HiddenStore(KIMI_OUT / f"split_{backend}" / "hidden")
        for r in got["records"]:
            truth, same = truths[r["id"]]
            assert r["output_ids"] == truth, (backend, r["id"], r.get("split_check"))
            assert r["evidence"] == ("text_proven" if same else "target_resolved"), (
                backend, r["id"], r["evidence"],
            )  # fmt: skip
            prompt = kimi_split_check["prompts"][int(r["id"][1:])]
            assert store.tokens(r["id"])["input_ids"].tolist() == prompt + truth
    hf, sg = (kimi_split_check[b]["summary"]["resolve"]["counts"] for b in ("hf", "sglang"))
    assert hf == sg, (hf, sg)
