"""Messages on the shared host tier's socket (AF_UNIX, SOCK_SEQPACKET).

One message is one JSON object (UTF-8), at most MAX_MESSAGE bytes; the owner's
replies to `acquire` carry the block's memfd as one SCM_RIGHTS descriptor
(socket.send_fds). Requests:

    {"op": "hello", "pid": int, "name": str}            -> {"ok": true, "budget": int, "covering": bool}
                                                           (covering: every block of the store fits
                                                           in the budget at once)
    {"op": "acquire", "items": [{"key": str, "version": int,
                                 "nbytes": int, "crc": int}, ...]}
                                                        -> per item, as its block is ready:
                                                           {"ok": true, "item", "key", "version", "nbytes", "crc",
                                                            "size"} + fd
                                                           or {"ok": false, "item", "key", "version", "code", "reason"}
    {"op": "release", "items": [{"key": str, "version": int}, ...]}    (no reply)
    {"op": "trace", "names": [str, ...]}                -> {"ok": true, "names": int}
    {"op": "status"}                                    -> {"ok": true, "status": {...}}

An acquire or release of one item may also be sent flat ({"op": "acquire", "key": ...}).
A batch (at most MAX_BATCH items) costs the owner one wake-up instead of one per
tensor; its replies come one per item, in the order the blocks are ready (a hit
before a fill), and name the item they answer ("item": its index in the batch).
Other requests are answered in order.

`check_request` is the owner's gate: anything else, or a batch with one bad item,
is refused as a whole with code "bad_request" and a reason (a reply naming no
item), never a crash of the owner.
"""
import json
import socket

from ..errors import unique_keys

MAX_MESSAGE = 192 << 10          # below the default unix socket send buffer (208 KiB)
MAX_KEY_BYTES = 1024             # the FileStore's key limit
MAX_NBYTES = 1 << 46
MAX_TRACE = 65536
MAX_BATCH = 16                   # items of one acquire or release: 16 keys of the longest JSON
                                 # (1 KiB of control characters, 6 KiB escaped) fit a message

# Refusal codes of an acquire (the client then reads from its own store).
BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"          # the owner's store has no such tensor
MISMATCH = "mismatch"            # the owner's store holds another version/content of it
NO_ROOM = "no_room"              # every block is leased: the budget cannot take this one
IO_ERROR = "io_error"            # the owner's checksummed read failed (the block fails closed)


class WireError(ValueError):
    """A message that is not a valid request; str(e) says why."""


def encode(obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    return data


def decode(data):
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"not a JSON message: {e}") from None
    if not isinstance(obj, dict):
        raise WireError(f"a message is a JSON object, got {type(obj).__name__}")
    return obj


def send(sock, obj, fd=None):
    data = encode(obj)
    if fd is None:
        sock.send(data)
    else:
        socket.send_fds(sock, [data], [fd])


def _int(msg, field, low, high):
    value = msg.get(field)
    if type(value) is not int or not low <= value <= high:
        raise WireError(f"{field}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _key(msg, field="key"):
    value = msg.get(field)
    if not isinstance(value, str):
        raise WireError(f"{field}: expected a string, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise WireError(f"{field}: not encodable as UTF-8") from None
    if not 1 <= size <= MAX_KEY_BYTES:
        raise WireError(f"{field}: {size} bytes; a key is 1..{MAX_KEY_BYTES} bytes of UTF-8")
    return value


def _ident(item):
    return {"key": _key(item), "version": _int(item, "version", 0, (1 << 64) - 1)}


def _acquire_item(item):
    return {**_ident(item), "nbytes": _int(item, "nbytes", 0, MAX_NBYTES),
            "crc": _int(item, "crc", 0, (1 << 32) - 1)}


def _items(msg, check_item):
    """The checked items of a batch request, or of a flat one-item request."""
    if "items" not in msg:
        return [check_item(msg)]
    items = msg["items"]
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH:
        raise WireError(f"items: expected a list of 1..{MAX_BATCH} items")
    checked = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise WireError(f"items[{i}]: expected an object, got {type(item).__name__}")
        try:
            checked.append(check_item(item))
        except WireError as e:
            raise WireError(f"items[{i}]: {e}") from None
    return checked


def check_request(msg):
    """The validated request as (op, args); WireError naming what is wrong."""
    op = msg.get("op")
    if op == "hello":
        name = msg.get("name", "")
        if not isinstance(name, str) or len(name) > 128:
            raise WireError("name: expected a string of at most 128 characters")
        return op, {"pid": _int(msg, "pid", 0, 1 << 31), "name": name}
    if op == "acquire":
        return op, {"items": _items(msg, _acquire_item)}
    if op == "release":
        return op, {"items": _items(msg, _ident)}
    if op == "trace":
        names = msg.get("names")
        if not isinstance(names, list) or len(names) > MAX_TRACE:
            raise WireError(f"names: expected a list of at most {MAX_TRACE} keys")
        return op, {"names": [_key({"k": n}, "k") for n in names]}
    if op == "status":
        return op, {}
    raise WireError(f"op: unknown {op!r} (hello, acquire, release, trace, status)")
