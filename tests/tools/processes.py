"""Finding the processes a test's command started, from outside any PID namespace they run in."""

import os
import time
import uuid


def unique_sleep() -> str:
    """A `sleep` argument no other process has: the sleeper can be found from outside its PID namespace,
    where the pid `$!` gives means nothing."""
    return f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9:09d}"


def running(argument: str, grace: float = 5.0) -> list[int]:
    """The live processes (zombies are dead) with `argument` in their command line, after up to `grace`
    seconds for them to go."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
                with open(f"/proc/{name}/stat") as f:
                    state = f.read().rsplit(") ", 1)[1][0]
            except OSError:
                continue  # exited meanwhile
            if argument.encode() in args and state != "Z":
                found.append(int(name))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)
