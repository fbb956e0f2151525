"""What the benchmarks read about processes and ports: a free loopback port, a process's
resident memory and its CPU time, from /proc."""

import random
import socket


def free_port():
    """A loopback port nothing listens on now, from 10000-19999: below the kernel's
    ephemeral range (32768-60999), where a port picked by binding port 0 would lie and an
    outgoing connection could take it as its source port before (or while a killed node is
    down, after) the server it was picked for binds it; and below 20000-32767, where the
    test suites that may run beside a benchmark pick theirs."""
    for _ in range(1000):
        port = random.randrange(10000, 20000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    """VmRSS in KiB, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_ticks(pid):
    """utime + stime of a process, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
