"""`prefetchd serve` requests with tensors, in real worker processes over real
sockets: outputs equal the model run locally, concurrent requests are batched and
each gets its own rows, and hostile headers or frames get BAD_REQUEST while the
server keeps serving."""
import os
import secrets
import socket
import threading

import numpy as np
import pytest
import zmq

from prefetchd.control import RequestTimeout, ServiceError
from prefetchd.control import protocol as P
from prefetchd.serve import Client, Front, ServeSpec
from prefetchd.serve.spec import demo_model
from prefetchd.serve.wire import MAX_RANK, MAX_TENSORS

SPEC = dict(models=2, hidden=64, layers=2, batch=2, seq=8, lookahead=1)
SHAPE = (SPEC["seq"], SPEC["hidden"])


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    spec = ServeSpec(store_dir=str(tmp_path_factory.mktemp("store")),
                     max_tensor_bytes=1 << 20, **SPEC)
    # One worker and a long queue delay: concurrent requests must meet in one batch.
    f = Front(f"ipc://req-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=1, spec=spec,
              request_timeout=30.0, name=f"rq{os.getpid()}", max_batch_size=8,
              max_queue_delay_ms=150).start()
    yield f
    f.close(10)


@pytest.fixture(scope="module")
def local():
    """The demo model's weight sets, resident, built as the workers build them."""
    spec = ServeSpec(**SPEC)
    return {f"m{i}": demo_model(seed=spec.seed + i, spec=spec)[0] for i in range(SPEC["models"])}


@pytest.fixture
def client(front):
    with Client(front.endpoint, timeout=30) as c:
        yield c


def _x(seed, batch):
    return np.random.default_rng(seed).standard_normal((batch,) + SHAPE).astype(np.float32)


def _run(cell, x):
    import mindspore as ms
    return cell(ms.Tensor(x)).asnumpy()


def test_outputs_are_the_resident_models_bit_for_bit(client, local):
    for model in ("m0", "m1"):
        x = _x(3, 3)
        (y,) = client.infer(model, x)
        assert y.dtype == np.float32 and np.array_equal(y, _run(local[model], x))


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(client, local, front):
    xs = [_x(10 + i, 1 + i % 2) for i in range(6)]         # 9 rows: more than one batch of 8
    futures = [client.submit("m0", x) for x in xs]
    outs = [f.result(60) for f in futures]
    sizes = [f.reply["batch_size"] for f in futures]
    assert max(sizes) > 1, sizes
    for x, (y,), f in zip(xs, outs, futures):
        assert y.shape[0] == x.shape[0]
        # Within float tolerance of the request run alone (a batch may sum in another order).
        np.testing.assert_allclose(y, _run(local["m0"], x), rtol=1e-5, atol=1e-5)
        assert f.reply["queue_seconds"] >= 0 and f.reply["batch_size"] >= x.shape[0]
    hist = front.snapshot()["histograms"]["m0"]
    assert hist["batch_size"]["count"] >= 1 and hist["queue_seconds"]["count"] >= len(xs)


def test_requests_from_many_threads_all_complete(client, local):
    results, errors = {}, []

    def run(i):
        try:
            results[i] = client.infer("m1", _x(i, 1), timeout=60)[0]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors and sorted(results) == list(range(8))
    for i, y in results.items():
        np.testing.assert_allclose(y, _run(local["m1"], _x(i, 1)), rtol=1e-5, atol=1e-5)


def _raw(front, body, tensors=(), op="infer"):
    """Send one request as raw frames; the reply document."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(front.endpoint)
        sock.send_multipart(P.encode_request(b"hostile!", op, body, 10, list(tensors)))
        assert sock.poll(15_000), "no reply"
        rid, doc, _ = P.decode_reply(sock.recv_multipart(), tensors=True)
        assert rid == b"hostile!"
        return doc
    finally:
        ctx.destroy(linger=0)


GOOD = np.zeros((1,) + SHAPE, np.float32)
HOSTILE = {
    "wrong dtype": ([{"dtype": "float64", "shape": [1, *SHAPE]}], [GOOD.astype(np.float64)],
                    "dtype float64, the model takes float32"),
    "unknown dtype": ([{"dtype": "object", "shape": [1, *SHAPE]}], [GOOD], "is not one of"),
    "wrong rank": ([{"dtype": "float32", "shape": [1, SHAPE[0] * SHAPE[1]]}], [GOOD],
                   "rank 2"),
    "wrong non-batch dim": ([{"dtype": "float32", "shape": [2, SHAPE[0] // 2, SHAPE[1]]}],
                            [GOOD], "dimension 1 is"),
    "frame too short": ([{"dtype": "float32", "shape": [2, *SHAPE]}], [GOOD], "its frame has"),
    "frame too long": ([{"dtype": "float32", "shape": [1, *SHAPE]}],
                       [np.zeros((2,) + SHAPE, np.float32)], "its frame has"),
    "huge shape": ([{"dtype": "float32", "shape": [2 ** 62, *SHAPE]}], [GOOD], "over the limit"),
    "over the size limit": ([{"dtype": "float32", "shape": [1024, *SHAPE]}],
                            [np.zeros((1024,) + SHAPE, np.float32)], "over the limit"),
    "missing frame": ([{"dtype": "float32", "shape": [1, *SHAPE]}], [], "missing frames"),
    "extra frame": ([{"dtype": "float32", "shape": [1, *SHAPE]}], [GOOD, GOOD], "extra frames"),
    "two inputs for one": ([{"dtype": "float32", "shape": [1, *SHAPE]}] * 2, [GOOD, GOOD],
                           "2 inputs, the model takes 1"),
    "negative dim": ([{"dtype": "float32", "shape": [-1, *SHAPE]}], [GOOD], "non-negative"),
    # its byte count has too many digits to print: the refusal's message failed, no reply
    "4300-digit dim": ([{"dtype": "float32", "shape": [int("9" * 4300), *SHAPE]}], [GOOD], "each at most 2**62"),
    "rank over the limit": ([{"dtype": "float32", "shape": [1] * (MAX_RANK + 1)}], [GOOD],
                            "at most"),
    "header not an object": (["float32"], [GOOD], "exactly 'dtype' and 'shape'"),
    "extra header key": ([{"dtype": "float32", "shape": [1, *SHAPE], "offset": 8}], [GOOD],
                         "exactly 'dtype' and 'shape'"),
    "too many tensors": ([{"dtype": "float32", "shape": [1]}] * (MAX_TENSORS + 1), [], "at most"),
    "empty batch": ([{"dtype": "float32", "shape": [0, *SHAPE]}], [b""], "empty batch"),
    "inputs not a list": ({"dtype": "float32"}, [GOOD], "must be a list"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_and_frames_are_refused_and_serving_goes_on(front, client, case):
    headers, frames, why = HOSTILE[case]
    doc = _raw(front, {"model": "m0", "inputs": headers}, frames)
    assert doc["ok"] is False and doc["code"] == P.BAD_REQUEST, doc
    assert why in doc["reason"], doc["reason"]
    assert client.infer("m0", GOOD)[0].shape[0] == 1          # still serving


def test_other_refusals(front, client):
    assert "needs 'inputs'" in _raw(front, {"model": "m0"})["reason"]
    assert "unknown model" in _raw(front, {"model": "m9", "inputs": []})["reason"]
    assert _raw(front, {"inputs": []})["reason"].startswith("infer: needs 'model'; models: m0")
    doc = _raw(front, {}, op="x" * 5000)          # the reason was 5000 characters of the op
    assert doc["code"] == P.BAD_REQUEST and len(doc["reason"]) < 400 and "unknown op" in doc["reason"], doc
    doc = _raw(front, {}, [GOOD], op="ping")
    assert doc["code"] == P.BAD_REQUEST and "carry tensors" in doc["reason"]
    doc = _raw(front, {"model": "m0", "inputs": [{"dtype": "float32", "shape": [1, *SHAPE]}],
                       "max_new_tokens": 4}, [GOOD], op="generate")
    assert doc["code"] == P.BAD_REQUEST and "no generate method" in doc["reason"]
    with pytest.raises(ServiceError, match="dimension 2 is 3"):
        client.infer("m0", np.zeros((1, SHAPE[0], 3), np.float32))
    with pytest.raises(ValueError, match="not carried on the wire"):
        client.infer("m0", np.array([["a"]]))
    assert client.infer("m0", GOOD)[0].shape[0] == 1


def test_a_request_whose_connection_closed_before_it_was_read_is_dropped_quietly(front, client):
    """libzmq refuses zmq.SRCFD of a message whose connection has closed (EINVAL): the front
    logged an ERROR traceback for each such message, which any peer sending junk and hanging
    up could make (an outside probe). Nobody is left to answer; serving goes on. A frame made
    here has no connection either, so the query fails the same way."""
    frames = [zmq.Frame(b"\x00peer"), zmq.Frame(b""), zmq.Frame(P.MAGIC), zmq.Frame(b"x" * P.RID_SIZE)]
    with pytest.raises(zmq.ZMQError):
        frames[0].get(zmq.SRCFD)
    assert front._on_request(frames) is None
    assert client.infer("m0", GOOD)[0].shape[0] == 1


def test_a_peer_that_sends_junk_is_dropped_and_serving_goes_on(front, client):
    """An HTTP request read to libzmq as a ZMTP 1.0 greeting: the peer held its connection
    for good (an outside probe); it is refused at its first bytes now (control/connections.py)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        peer.connect(front.endpoint[len("ipc://"):])
        peer.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        peer.settimeout(5)
        try:
            while peer.recv(4096):
                pass
        except ConnectionResetError:
            pass                       # closed, either way; a timeout fails the test
    assert client.infer("m0", GOOD)[0].shape[0] == 1


def test_a_timeout_answered_by_the_server_names_the_clients_own_timeout(client):
    """The front names its share of the client's timeout (0.9 t - 0.05 s, at least 1 ms), so
    timeout=0.05 read "did not complete within 0.001s" (an outside probe): the client adds its own."""
    # One row waits out the batcher's 150 ms for batch-mates: past the server's 0.13 s.
    with pytest.raises(RequestTimeout, match=r"did not complete within 0\.13s .*"
                                             r"\(the client's timeout: 0\.2s, of which the server gets"):
        client.infer("m0", GOOD, timeout=0.2)
    assert client.infer("m0", GOOD)[0].shape[0] == 1
