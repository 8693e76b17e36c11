"""Run a stdio MCP server and keep its wire log: every line it reads (``> ``) and writes (``< ``), in order.

``python wire_tap.py LOG -- COMMAND...``: the server is COMMAND, unchanged; LOG is what it was told and what it
answered, so a test can show what reached the upstream itself (a ``notifications/cancelled`` naming its request,
and no answer to that request after it). ``LOG.pid`` holds the server's process id (rewritten each time the tap
starts one), for a test that kills it as a crash would; the tap exits with it, closing the connection.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import IO, Any


def main() -> int:
    log_path, sep, *command = sys.argv[1:]
    assert sep == "--" and command, "usage: wire_tap.py LOG -- COMMAND..."
    lock = threading.Lock()
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - open for the process's life
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    with open(log_path + ".pid", "w") as pid:  # noqa: PTH123 - a plain path string, as LOG is
        pid.write(f"{child.pid}\n")

    def pump(src: IO[bytes], dst: IO[bytes], mark: bytes) -> None:
        for line in iter(src.readline, b""):
            with lock:
                log.write(mark + line)
            dst.write(line)
            dst.flush()
        dst.close()

    def stop(*_: Any) -> None:
        # The server dies with the tap: server-everything keeps running after its stdin closes (its timers), and
        # an orphan left by a terminated or SIGKILLed gateway would outlive the test.
        child.terminate()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)

    def pump_in() -> None:
        pump(sys.stdin.buffer, child.stdin, b"> ")
        # The gateway closed the connection (or died): give the server a moment to leave on its own, then end it.
        try:
            child.wait(timeout=3)
        except subprocess.TimeoutExpired:
            child.terminate()

    into = threading.Thread(target=pump_in, daemon=True)
    into.start()
    pump(child.stdout, sys.stdout.buffer, b"< ")
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
