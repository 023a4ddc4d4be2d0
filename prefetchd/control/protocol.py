"""Wire format of the prefetchd control plane (ZeroMQ DEALER -> ROUTER).

A request is three frames::

    [b"PFD1", request_id (8 bytes), JSON {"op": str, "args": {...}, "timeout": seconds?}]

and its reply carries the same magic and request id::

    [b"PFD1", request_id, JSON {"ok": true, "result": ...}]
    [b"PFD1", request_id, JSON {"ok": false, "code": CODE, "reason": str}]

A ROUTER prepends the peer identity (and REQ peers an empty delimiter), which
the server strips and echoes. Events on the PUB socket are two frames,
``[topic, JSON event]``. A `prefetchd serve` infer request or reply may carry
tensor frames after the body (prefetchd.serve.wire). JSON, not pickle: a peer never makes the server run
code, and a body is bounded by `max_message_size` before it is parsed.
"""
import json
import math
import os
import struct

from ..errors import unique_keys

MAGIC = b"PFD1"
RID_SIZE = 8
DEFAULT_MAX_MESSAGE_SIZE = 1 << 20
NO_RID = b"\0" * RID_SIZE
MAX_TIMEOUT = 1e9           # seconds; larger request timeouts are refused (BAD_REQUEST)

# Error codes of a reply. Daemon errors map onto prefetchd.errors on the client.
BAD_REQUEST = "BAD_REQUEST"
UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
TOO_LARGE = "TOO_LARGE"
BUSY = "BUSY"
UNKNOWN_TENSOR = "UNKNOWN_TENSOR"
BUDGET = "BUDGET"
PINNED = "PINNED"
SHUTDOWN = "SHUTDOWN"
STORAGE = "STORAGE"
INTERNAL = "INTERNAL"
TIMEOUT = "TIMEOUT"
CODES = (BAD_REQUEST, UNSUPPORTED_VERSION, TOO_LARGE, BUSY, UNKNOWN_TENSOR, BUDGET,
         PINNED, SHUTDOWN, STORAGE, INTERNAL, TIMEOUT)

TOPICS = (b"loaded", b"evicted", b"written_back", b"failed")
SYNC_TOPIC = b"_sync"


class ProtocolError(Exception):
    """A frame the server cannot serve; `code` and `reason` go into the reply."""

    def __init__(self, code, reason, rid=NO_RID):
        super().__init__(reason)
        self.code, self.reason, self.rid = code, reason, rid


def dropped_above(max_message_size):
    """A server router's maxmsgsize: libzmq drops a larger frame (and its connection) before
    the server sees it, unanswered; a body up to it is read, so one over max_message_size
    is answered TOO_LARGE."""
    return 4 * max_message_size + 64


def new_rid(counter):
    """An 8-byte request id: 4 bytes of pid (tells processes apart), 4 of a counter."""
    return struct.pack(">II", os.getpid() & 0xFFFFFFFF, counter & 0xFFFFFFFF)


def _no_constants(token):
    raise ValueError(f"{token} is not a number JSON allows")


def dumps(obj):
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def loads(data, object_pairs_hook=None):
    return json.loads(data, parse_constant=_no_constants, object_pairs_hook=object_pairs_hook)


def encode_request(rid, op, args=None, timeout=None, tensors=()):
    """The frames of a request; `tensors` are frames after the body (prefetchd.serve.wire)."""
    body = {"op": op, "args": args or {}}
    if timeout is not None:
        body["timeout"] = timeout
    return [MAGIC, rid, dumps(body), *tensors]


def encode_ok(rid, result, tensors=()):
    return [MAGIC, rid, dumps({"ok": True, "result": result}), *tensors]


def encode_error(rid, code, reason):
    return [MAGIC, rid, dumps({"ok": False, "code": code, "reason": str(reason)[:2000]})]


def split_envelope(frames):
    """(identity envelope, payload frames) of a message received on a ROUTER.

    The envelope is the identity plus, for REQ peers, the empty delimiter; it is
    echoed in front of the reply so that both DEALER and REQ peers are answered.
    """
    if len(frames) >= 2 and frames[1] == b"":
        return frames[:2], frames[2:]
    return frames[:1], frames[1:]


BODY_FIELDS = frozenset({"op", "args", "timeout"})


def decode_request(payload, max_message_size=DEFAULT_MAX_MESSAGE_SIZE):
    """(rid, op, args, timeout) of a request's payload frames; ProtocolError if unusable.

    The request id is recovered first, so that even a refusal can be matched by
    the client that sent it.
    """
    rid = payload[1] if len(payload) >= 2 and len(payload[1]) == RID_SIZE else NO_RID
    if not payload:
        raise ProtocolError(BAD_REQUEST, "empty message", rid)
    magic = payload[0]
    if magic != MAGIC:
        if magic[:3] == MAGIC[:3] and len(magic) == len(MAGIC):
            raise ProtocolError(UNSUPPORTED_VERSION,
                                f"protocol {magic[3:]!r} not supported; this server speaks "
                                f"{MAGIC.decode()}", rid)
        raise ProtocolError(BAD_REQUEST, f"first frame must be {MAGIC!r}", rid)
    if len(payload) != 3:
        raise ProtocolError(BAD_REQUEST,
                            f"expected 3 frames [magic, request id, body], got {len(payload)}", rid)
    if len(payload[1]) != RID_SIZE:
        raise ProtocolError(BAD_REQUEST, f"request id must be {RID_SIZE} bytes", rid)
    body = payload[2]
    if len(body) > max_message_size:
        raise ProtocolError(TOO_LARGE, f"body of {len(body)} bytes exceeds the limit of "
                            f"{max_message_size} bytes", rid)
    try:
        # (json.loads of bytes also took UTF-16 and 32; a UTF-8 byte order mark it skipped)
        text = bytes(body).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ProtocolError(BAD_REQUEST, f"body is not UTF-8: {e.reason} at byte {e.start}", rid) from None
    try:
        doc = loads(text, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(BAD_REQUEST, f"body is not JSON: {str(e)[:200]}", rid) from None
    if not isinstance(doc, dict):
        raise ProtocolError(BAD_REQUEST, "body must be a JSON object", rid)
    unknown = sorted(set(doc) - BODY_FIELDS)
    if unknown:   # (a misspelled 'timout' was ignored: the request ran without its timeout)
        raise ProtocolError(BAD_REQUEST, f"unknown field {unknown[0][:64]!r} in the body; it takes "
                            f"{', '.join(sorted(BODY_FIELDS))}", rid)
    op, args, timeout = doc.get("op"), doc.get("args", {}), doc.get("timeout")
    if not isinstance(op, str):
        raise ProtocolError(BAD_REQUEST, "body needs an 'op' string", rid)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(BAD_REQUEST, "'args' must be a JSON object", rid)
    if timeout is not None and not _positive_number(timeout, MAX_TIMEOUT):
        raise ProtocolError(BAD_REQUEST, f"'timeout' must be a positive number of seconds, "
                            f"at most {MAX_TIMEOUT:g}", rid)
    return rid, op, args, timeout


def decode_reply(frames, tensors=False):
    """(rid, doc) of a reply received on a DEALER; ProtocolError if it is not one.
    tensors=True: (rid, doc, the frames after the body), for replies that carry tensors
    (frames may then be zmq.Frames: only the first three are read as bytes)."""
    if tensors:
        head = [f.bytes if hasattr(f, "bytes") else f for f in frames[:3]]
        rid, doc = decode_reply(head)
        return rid, doc, frames[3:]
    if len(frames) != 3 or frames[0] != MAGIC or len(frames[1]) != RID_SIZE:
        raise ProtocolError(BAD_REQUEST, "malformed reply")
    try:
        doc = loads(frames[2])
    except (ValueError, RecursionError):
        raise ProtocolError(BAD_REQUEST, "reply body is not JSON") from None
    if not isinstance(doc, dict) or "ok" not in doc:
        raise ProtocolError(BAD_REQUEST, "reply body lacks 'ok'")
    return frames[1], doc


def _positive_number(value, maximum):
    """Whether `value` is a JSON number in (0, maximum]. Integers are compared as
    integers: a 4000-digit one would overflow float() and must be refused, not crash."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return 0 < value <= maximum
    return isinstance(value, float) and math.isfinite(value) and 0 < value <= maximum
