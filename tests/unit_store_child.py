"""Helpers of tests/test_unit_store.py, and the writer it kills (run as a script).

As a script: claim unit u-000000 of the store named by the environment (renewing the lease
as a worker does), write every sample's data objects, then stop just before the index (print
READY and sleep) so that the test can SIGKILL the process mid-commit.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimi_pipe.store.hidden_store import make_manifest  # noqa: E402
from kimi_pipe.store.units import UnitStore, UnitWriter  # noqa: E402

H = 8
LAYERS = (1, 3, 4)
FAKE_KEY = "testing"  # moto accepts any key; never a real credential


def manifest(dtype: str = "float32", hidden: int = H) -> dict[str, Any]:
    return make_manifest(
        model="tiny",
        num_layers=8,
        layer_ids=list(LAYERS),
        hidden_size=hidden,
        dtype=dtype,
        loss_mask="prompt=0 output=1",
        source_runs=["runs/x"],
        backend="test",
    )


def sample_id(i: int) -> str:
    return f"s{i:04d}"


def sample(
    sid: str, hidden: int = H, length: int | None = None
) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """The sample of an id: its length and states follow from the id, so mix-ups show."""
    i = int(sid[1:])
    n = length if length is not None else 1 + i % 6
    ids = [(i * 7 + k) % 1000 for k in range(n)]
    mask = [0] + [1] * (n - 1)
    g = torch.Generator().manual_seed(i)
    aux = torch.randn(n, len(LAYERS) * hidden, generator=g) + i
    final = torch.randn(n, hidden, generator=g) - i
    return ids, mask, aux, final


def fill(writer: UnitWriter, hidden: int = H, length: int | None = None) -> None:
    for sid in writer.unit.ids:
        writer.add(sid, *sample(sid, hidden, length))


def s3_fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(
        key=FAKE_KEY,
        secret=FAKE_KEY,
        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
        skip_instance_cache=True,
        use_listings_cache=False,
    )


def open_store(kind: str, root: str, endpoint: str = "", lease_s: float = 600.0) -> UnitStore:
    import fsspec

    fs = s3_fs(endpoint) if kind == "s3" else fsspec.filesystem("file")
    return UnitStore(fs, root, lease_s=lease_s)


def main() -> None:
    store = open_store(
        os.environ["UNIT_TEST_KIND"],
        os.environ["UNIT_TEST_ROOT"],
        os.environ.get("UNIT_TEST_ENDPOINT", ""),
        float(os.environ["UNIT_TEST_LEASE_S"]),
    )
    lease = store.claim("u-000000", "victim")
    assert lease is not None, "the victim could not claim its unit"

    def stop_before_index(self: UnitWriter, body: dict[str, Any]) -> Any:
        print("READY", flush=True)
        time.sleep(600)  # killed here: data objects written, index not

    UnitWriter._publish = stop_before_index  # type: ignore[method-assign]
    with lease.keepalive():  # a live worker's heartbeat: the lease ends lease_s after the kill
        writer = store.writer(lease, part_bytes=200)  # several data objects
        fill(writer)
        writer.commit()


if __name__ == "__main__":
    main()
