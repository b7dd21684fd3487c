"""The GCS emulator keeps GCS's upload preconditions (issue 28, point 6).

fake-gcs-server, built from its pinned module, on both of its backends: a create-only upload
(`ifGenerationMatch=0`) succeeds once and then answers 412, a stale generation answers 412 and
leaves the object as it was, for each upload type a client may use; TensorStore's gcs kvstore,
which uploads with `uploadType=media` only, reports such a write as a failed condition. The
preconditions it does not check are pinned here as documented in local_cluster/README.md ("The
GCS emulator"), so a newer emulator that starts checking them shows up.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
import tensorstore as ts
from tardigrade_local.gcs import GcsEmulator, client_env

BUCKET = "tardigrade-preconditions"


@pytest.fixture(scope="module", params=["memory", "filesystem"])
def gcs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[GcsEmulator]:
    work = tmp_path_factory.mktemp(f"gcs-{request.param}")
    data_dir = work / "data" if request.param == "filesystem" else None
    with GcsEmulator(log_path=work / "gcs.log", log_requests=True, data_dir=data_dir) as emulator:
        emulator.create_bucket(BUCKET)
        yield emulator


def _call(method: str, url: str, body: bytes = b"",
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body if method != "GET" else None, method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _query(name: str, if_generation_match: int | None) -> str:
    query = {"name": name}
    if if_generation_match is not None:
        query["ifGenerationMatch"] = str(if_generation_match)
    return urllib.parse.urlencode(query)


def _media(gcs: GcsEmulator, name: str, data: bytes, match: int | None) -> int:
    url = f"{gcs.url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&{_query(name, match)}"
    return _call("POST", url, data, {"Content-Type": "application/octet-stream"})[0]


def _multipart(gcs: GcsEmulator, name: str, data: bytes, match: int | None) -> int:
    boundary = "tardigrade-boundary"
    body = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': name})}\r\n--{boundary}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + data + (
            f"\r\n--{boundary}--\r\n").encode()
    query = "" if match is None else f"&ifGenerationMatch={match}"
    url = f"{gcs.url}/upload/storage/v1/b/{BUCKET}/o?uploadType=multipart{query}"
    return _call("POST", url, body, {"Content-Type": f"multipart/related; boundary={boundary}"})[0]


def _resumable(gcs: GcsEmulator, name: str, data: bytes, match: int | None) -> int:
    """Start a session, then send everything in one request; the first refusal's status."""
    url = f"{gcs.url}/upload/storage/v1/b/{BUCKET}/o?uploadType=resumable&{_query(name, match)}"
    status, headers, _ = _call("POST", url, b"", {"Content-Type": "application/json"})
    if status != 200:
        return status
    session = headers["Location"]
    return _call("PUT", session, data, {
        "Content-Type": "application/octet-stream",
        "Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"})[0]


UPLOADS = {"media": _media, "multipart": _multipart, "resumable": _resumable}


def _stored(gcs: GcsEmulator, name: str) -> tuple[bytes, int]:
    quoted = urllib.parse.quote(name, safe="")
    status, _, data = _call("GET", f"{gcs.url}/storage/v1/b/{BUCKET}/o/{quoted}?alt=media")
    assert status == 200, (status, data)
    _, _, meta = _call("GET", f"{gcs.url}/storage/v1/b/{BUCKET}/o/{quoted}")
    return data, int(json.loads(meta)["generation"])


@pytest.mark.parametrize("upload", sorted(UPLOADS))
def test_a_create_only_upload_succeeds_once_then_answers_412(gcs, upload):
    put = UPLOADS[upload]
    name = f"create-only/{upload}"
    assert put(gcs, name, b"first", 0) == 200
    assert put(gcs, name, b"second", 0) == 412
    assert _stored(gcs, name)[0] == b"first"


@pytest.mark.parametrize("upload", sorted(UPLOADS))
def test_a_write_on_a_stale_generation_answers_412_and_changes_nothing(gcs, upload):
    put = UPLOADS[upload]
    name = f"stale/{upload}"
    assert put(gcs, name, b"v1", None) == 200
    _, read_at = _stored(gcs, name)
    assert put(gcs, name, b"v2 by whoever read first", read_at) == 200
    data, now_at = _stored(gcs, name)
    assert now_at != read_at
    # The other writer read v1 too: its compare-and-swap must fail, whatever the upload type.
    assert put(gcs, name, b"v2 by the other writer", read_at) == 412
    assert _stored(gcs, name) == (data, now_at)
    # Generations are real numbers GCS style: the current one is accepted.
    assert put(gcs, name, b"v3", now_at) == 200


@pytest.fixture
def kvstore(gcs: GcsEmulator) -> Iterator[ts.KvStore]:
    saved = {k: os.environ.get(k) for k in client_env(gcs.url)}
    os.environ.update(client_env(gcs.url))
    try:
        # A fresh context: TensorStore keeps one driver per spec and context resources, and a
        # driver reads TENSORSTORE_GCS_HTTP_URL when it opens.
        context = ts.Context({"gcs_request_retries": {"max_retries": 2}})
        yield ts.KvStore.open({"driver": "gcs", "bucket": BUCKET, "path": "kv/"},
                              context=context).result()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_tensorstore_conditional_writes_are_refused_when_stale(gcs, kvstore):
    missing = kvstore.read("record").result()
    assert missing.state == "missing"
    first = kvstore.write("record", b"a", if_equal=missing.stamp.generation).result()
    assert first.generation
    # Create-only again (a rival read the same absence): refused, reported as an empty
    # generation, which is TensorStore's "condition failed".
    again = kvstore.write("record", b"b", if_equal=missing.stamp.generation).result()
    assert not again.generation
    second = kvstore.write("record", b"c", if_equal=first.generation).result()
    assert second.generation and second.generation != first.generation
    stale = kvstore.write("record", b"d", if_equal=first.generation).result()
    assert not stale.generation
    assert bytes(kvstore.read("record").result().value) == b"c"
    # TensorStore's gcs driver sends every write as a media upload (its WriteTask), so the
    # media upload's checks above are the ones it meets.
    writes = [(path, status) for method, path, status in gcs.answers()
              if method == "POST" and "name=kv%2Frecord" in path]
    assert [status for _, status in writes] == [200, 412, 200, 412]
    assert all("uploadType=media" in path and "ifGenerationMatch=" in path
               for path, _ in writes), writes


def test_the_preconditions_it_does_not_check_are_the_documented_ones(gcs):
    """local_cluster/README.md, "The GCS emulator": GET, DELETE, compose, rewrite and
    metageneration preconditions are ignored (GCS would answer 412 to each below)."""
    base = f"{gcs.url}/storage/v1/b/{BUCKET}/o"
    assert _media(gcs, "ignored/source", b"s", None) == 200
    assert _media(gcs, "ignored/target", b"t", None) == 200
    _, generation = _stored(gcs, "ignored/target")
    stale = generation - 1
    target = urllib.parse.quote("ignored/target", safe="")
    source = urllib.parse.quote("ignored/source", safe="")
    assert _call("GET", f"{base}/{target}?alt=media&ifGenerationMatch={stale}")[0] == 200
    compose = json.dumps({"sourceObjects": [{"name": "ignored/source"}]}).encode()
    assert _call("POST", f"{base}/{target}/compose?ifGenerationMatch={stale}", compose,
                 {"Content-Type": "application/json"})[0] == 200
    assert _call("POST", f"{base}/{source}/rewriteTo/b/{BUCKET}/o/{target}"
                 f"?ifGenerationMatch={stale}", b"", {"Content-Type": "application/json"}
                 )[0] == 200
    url = (f"{gcs.url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name=ignored%2Ftarget"
           "&ifMetagenerationMatch=99")
    assert _call("POST", url, b"m", {"Content-Type": "application/octet-stream"})[0] == 200
    assert _call("DELETE", f"{base}/{target}?ifGenerationMatch={stale}")[0] in (200, 204)
    assert _call("GET", f"{base}/{target}")[0] == 404
