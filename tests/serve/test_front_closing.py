"""`prefetchd serve` stopping (SIGTERM): its workers take seconds to stop, and the clients'
socket was closed before them, so a request sent meanwhile got no reply and its client
waited out its whole timeout (an outside probe: 78 of 78 requests sent after the signal).
Each is answered SHUTDOWN now, until the front exits. A real server and client."""
import signal
import time

from helpers import ENV, start_serve
from prefetchd.control import Client, RequestTimeout
from prefetchd.errors import ShutdownError

SMALL = ["--models", "1", "--hidden", "64", "--layers", "2", "--seq", "8"]


def test_requests_sent_while_the_front_stops_are_answered_shutdown(tmp_path):
    endpoint = f"ipc://{tmp_path}/closing.sock"
    proc = start_serve(endpoint, [*SMALL, "--store", str(tmp_path / "s")], ENV, workers=2)
    answered = shutdowns = lost = 0
    with Client(endpoint, timeout=2) as c:
        assert c.ping()["pong"]
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        while proc.poll() is None and time.monotonic() - started < 60:
            try:
                c.ping()
                answered += 1
            except ShutdownError:
                shutdowns += 1
            except RequestTimeout:
                lost += 1
    assert proc.wait(30) == 0, proc.stderr.read()[-2000:]
    # The last one may go with the socket, in the instant the front exits.
    assert shutdowns >= 1 and lost <= 1, (answered, shutdowns, lost)


def test_the_front_gives_its_workers_their_configured_shutdown_timeout(tmp_path):
    """A worker closes its daemon within the configured shutdown_timeout (dirty write-back):
    the front's close() waited a fixed 10 s and then killed it, whatever that said."""
    from prefetchd.serve.front import Front
    from prefetchd.serve.spec import ServeSpec
    config = tmp_path / "prefetchd.toml"
    config.write_text("[prefetchd]\nshutdown_timeout = 40\n")
    front = Front(f"ipc://{tmp_path}/t.sock", spec=ServeSpec(config_path=str(config)))
    assert front.stop_timeout == 45.0
    config.write_text("[prefetchd]\nshutdown_timeout = 1\n")
    assert Front(f"ipc://{tmp_path}/u.sock", spec=ServeSpec(config_path=str(config))).stop_timeout == 10.0
