"""An embedded OpenAI-compatible server for a local model: started, health-checked, always stopped.

`transformers serve DIR` (extra `transformers[serving]`) answers `/v1/chat/completions` with
usage. It is run as a child process (`python -m transformers.cli.transformers serve`, so no
PATH lookup) bound to 127.0.0.1 on a free port, with its log in the run directory. The child
gets its own process group so that stopping it also stops anything it spawned.

The request `model` must be the served directory exactly (the server is pinned to it), so the
LiteLLM model string is `openai/<dir>`; `api_base` is only known once the port is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kimi_pipe.errors import ConfigError, ProviderError
from kimi_pipe.store.local_model import LocalModelSpec, ensure_local_model

# The child must never reach the network: no Hub look-ups, no PyPI update check.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


class ServerError(ProviderError):
    """The local server did not come up (the message carries the tail of its log)."""


@dataclass(frozen=True)
class ServerSettings:
    kind: str = "transformers_serve"
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None  # torch CPU threads (OMP_NUM_THREADS); None = torch default
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> ServerSettings:
        kind = str(cfg.get("kind", "transformers_serve"))
        if kind != "transformers_serve":
            raise ConfigError(
                f"provider.server.kind {kind!r} is not supported (transformers_serve)"
            )
        return cls(
            kind=kind,
            device=str(cfg.get("device", "cpu")),
            dtype=str(cfg.get("dtype", "auto")),
            threads=int(cfg["threads"]) if cfg.get("threads") else None,
            startup_timeout_s=float(cfg.get("startup_timeout_s", 600)),
            stop_timeout_s=float(cfg.get("stop_timeout_s", 15)),
            extra_args=tuple(str(a) for a in (cfg.get("extra_args") or ())),
        )


@dataclass(frozen=True)
class LocalServer:
    """A running server: what a client needs to reach it."""

    model_dir: Path
    host: str
    port: int
    pid: int
    log_path: Path

    @property
    def api_base(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def model(self) -> str:
        """The `model` a request must name (the server is pinned to this directory)."""
        return str(self.model_dir)

    @property
    def litellm_model(self) -> str:
        return f"openai/{self.model}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(model_dir: Path, host: str, port: int, settings: ServerSettings) -> list[str]:
    return [
        sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
        "--device", settings.device, "--dtype", settings.dtype,
        "--host", host, "--port", str(port), "--log-level", "warning",
        *settings.extra_args,
    ]  # fmt: skip


@contextlib.contextmanager
def serve_local(
    model_dir: Path,
    log_dir: Path,
    settings: ServerSettings | None = None,
    host: str = "127.0.0.1",
) -> Iterator[LocalServer]:
    """Run `transformers serve model_dir` for the duration of the block; always stop it."""
    settings = settings or ServerSettings()
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} is not a model directory (no config.json); "
            "create it with `python -m kimi_pipe.store.local_model`"
        )
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "local_server.log"
    port = free_port(host)
    env = {**os.environ, **OFFLINE_ENV}
    if settings.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(settings.threads)
    with open(log_path, "ab") as log:
        log.write(f"\n=== start {time.strftime('%Y-%m-%dT%H:%M:%S')} port {port}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            server_command(model_dir, host, port, settings),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # own process group: stop() reaches its children too
        )
    server = LocalServer(model_dir, host, port, proc.pid, log_path)
    try:
        _wait_healthy(proc, server, settings.startup_timeout_s)
        yield server
    finally:
        _stop(proc, settings.stop_timeout_s)


def _wait_healthy(proc: subprocess.Popen, server: LocalServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    url = f"http://{server.host}:{server.port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(
                f"local server exited with code {proc.returncode} before it was healthy; "
                f"log {server.log_path}:\n{_tail(server.log_path)}"
            )
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet: the model is still loading
        time.sleep(0.5)
    raise ServerError(
        f"local server not healthy after {timeout_s:.0f}s; log {server.log_path}:\n"
        f"{_tail(server.log_path)}"
    )


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def provider_endpoint(
    provider: Mapping[str, Any], model: Mapping[str, Any], run_dir: Path
) -> Iterator[dict[str, Any]]:
    """LiteLLM `model` and `api_base` for the `provider` settings.

    A provider with a `server` block (provider=local) gets its server started here, around
    the block, serving the `model` settings' `local_model`, with the log in `run_dir`; any
    other provider is passed through unchanged.
    """
    server_cfg = provider.get("server")
    if not server_cfg:
        yield {"model": provider.get("model"), "api_base": provider.get("api_base")}
        return

    local = model.get("local_model")
    if not local:
        raise ConfigError(
            f"provider={provider.get('name')} serves a local model, but "
            f"model={model.get('name')} has no `local_model` block (try model=smollm2)"
        )
    model_dir = ensure_local_model(LocalModelSpec.from_cfg(local))
    with serve_local(model_dir, run_dir, ServerSettings.from_cfg(server_cfg)) as server:
        yield {"model": server.litellm_model, "api_base": server.api_base, "server": server}
