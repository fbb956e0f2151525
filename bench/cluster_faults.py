#!/usr/bin/env python3
"""A Jepsen-style safety checker for R3 file streams (or memory streams, --storage memory):
keel-server and nats-server side by side in one run.

For each server in turn: a 3-node cluster of separate processes, one R3 file stream
(allow_direct), --pubs publishers (nats-py; each publish waits for its PubAck). Every acked
publish is recorded as (seq, payload); every publish that timed out or failed is recorded as
"unknown" (it may or may not be in the stream). While they publish, a fault schedule runs:

  kill-leader     SIGKILL the stream leader (STREAM.INFO cluster.leader), restart it on
                  the same store after --down seconds
  kill-follower   the same for one of the replicas
  stop-leader     SIGSTOP the leader for --stop seconds (longer than the election timeout),
                  then SIGCONT
  power-loss      SIGKILL all three at the same moment, restart all (a process kill: the
                  page cache survives, so data written but not fsynced is NOT lost; this
                  only catches bugs in what is written, not in when it is fsynced)
  power-loss-disk a real power loss of all three (disk mode, below): SIGKILL all three,
                  then each node's disk image is copied as it is at that moment, the
                  mounted filesystems are dropped with their dirty pages, the copies are
                  mounted in their place (ext4 replays its journal) and all restarted: data
                  not fsynced is lost, unless writeback happened to write it. Without disk
                  mode it is the same as power-loss.
  partition-leader    cut the stream leader off from both other nodes for --partition
                  seconds, and at least until the majority (asked directly) names a new
                  leader, then heal
  partition-follower  the same for one of the replicas (the leader keeps its majority)
  bridge          cut only the link between the leader and one replica; the third node
                  still reaches both (a non-transitive partition)
  bitflip-follower  SIGKILL one of the replicas, flip one random bit in each of --flips
                  random places of the files that hold the stream on it (its message
                  files and its Raft group's log: paths naming the stream or its
                  raft_group, chosen by size), restart it after --down seconds (Jepsen's
                  single-bit error on a minority node)
  clock-jump      the stream leader's wall clock steps 2 h ahead and a follower's 1 h back
                  (libfaketime preloaded into each node; only CLOCK_REALTIME moves, as when
                  NTP steps a clock; each step is confirmed by the node's /varz `now`);
                  after --stop seconds of publishing, leadership moves to that follower
                  (STREAM.LEADER.STEPDOWN with placement.preferred), which stamps messages
                  3 h before the ones they follow; after --stop seconds more it is
                  SIGKILLed and restarted; then both clocks step back to the true time.
                  The report counts the message times that step back, and a sequence
                  whose time differs between replicas counts as divergent. Only where the server's
                  clock can be reached: not nats-server (a static Go binary reads the clock
                  through the vDSO, where no LD_PRELOAD reaches; the fault is skipped there)
  disk-full-leader, disk-full-follower  (disk mode only) every free block of that node's
                  filesystem taken by a file for --stop seconds while the publishers go on
                  (writes there fail with ENOSPC), then freed; the checker then waits up to
                  60 s for every replica to be current again and logs how long it took
  rescale         the stream scaled down to R1 and back to R3 while the publishers go on
                  (STREAM.UPDATE num_replicas): the removed replicas drop their copy, the
                  new ones catch up (on keel from a snapshot and the leader's messages once
                  the log is compacted); the next fault waits until both are current

Partitions cut the route connections only (the publishers' client connections are not
partitioned; those on a cut-off leader time out, which makes unknown outcomes). The
nodes' routes go through a TCP proxy the checker runs on its own thread (Partitioner in
cluster_common.py): one listener per ordered pair of nodes, forwarding to the second's
cluster port, so each connection is known to run over one link. Cutting a link closes its
connections and closes new ones as soon as they are accepted (--partition-mode close), or
freezes them until the heal (hang: a network dropping packets, found by timeouts). Each
node advertises a cluster address nothing listens on, so a route learned by gossip cannot
bypass the proxy; each partition logs the connections it cut and the established routes
that bypass the proxy (there must be none).

Disk mode (--disks, on by default when possible: root, losetup, mkfs.ext4, mount and
/dev/loop-control; otherwise a message says so and power-loss-disk falls back to the process
kill): each node's store directory is the mount point of its own ext4 filesystem in a sparse
image file on a loop device (LoopDisk in cluster_common.py), mounted with a journal commit
every 60 s, and for the run the kernel's dirty page expiry (vm.dirty_expire_centisecs,
machine-wide; put back afterwards) is raised to 60 s (both --disk-window): that is the
window in which data written but not fsynced exists in memory only (Linux's defaults are
5 s and 30 s). The image copy holds only what ext4 wrote to the loop device: fsynced data,
journal commits, and what writeback wrote before the cut. The copy is not atomic, but the
processes are dead and writeback is delayed, so nothing writes meanwhile; each cut logs the
sectors written to the devices during the copy (0 if so). Disk mode starts with a self-check (also
--check-disks alone): on a small loop disk, a file written and fsynced, one written without
fsync, a power cut: the first must be intact and the second missing or short.

Then the publishers stop, the cluster is given time to converge, and all nodes are stopped
cleanly. Each node is then started ALONE (the others down) and the whole stream is read
back from its own store with direct gets ($JS.API.DIRECT.GET). A lone follower answers on
neither server (the reference serves direct gets on a follower only once it is current,
which needs a leader; keel forwards them to the stream leader), so a node that does not
answer alone is read later with all three up while it LEADS the stream (leadership moved
there by SIGTERMing the leader until that node is elected): a leader answers from its own
store. If even that fails and the meta leader says the stream does not exist (the
reference after a power cut), the replicas not read count as empty (every acked write lost
on each; "replicas read" says STREAM GONE). Checks:

  lost        an acked (seq, payload) missing from a replica, or a different payload there
              (counted per replica; the timeline also gives the distinct acked writes
              missing from some replica and from every replica read)
  divergent   a sequence holding different payloads on two replicas
  order       a publisher's acked payloads not in increasing sequence order (per replica,
              a publisher's payloads that are present must be in publish order)
  foreign     a payload in the stream that nobody published, or one payload at two seqs

Memory streams (--storage memory): the same, on an R3 memory stream, with the faults that
leave a quorum's memory: kill-leader, kill-follower, stop-leader, the partitions,
clock-jump and rescale (a killed server comes back empty, and a new replica starts empty:
both are refilled from their peers). Before each fault the checker waits (up to 60 s)
until every replica is current, so no fault takes the last full copy. power-loss,
power-loss-disk and bitflip-follower are refused (a memory stream keeps nothing through a
restart of all its servers, on both servers, and has no files). Replicas are read with all
three up: each in turn is made the stream's leader (STREAM.LEADER.STEPDOWN with
placement.preferred) and read through direct gets on its own server.

Consumer part (--consumer): a durable pull consumer (explicit ack) read by one worker with
AckSync acks (msg.ack_sync()); the server leading the stream (and the consumer) is killed
mid-way; checks that no message whose ack was confirmed is redelivered and that deliveries
of new messages come in stream order.

Usage: bench/cluster_faults.py [--short] [--storage file|memory] [--faults F1,F2,...]
                               [--disks auto|on|off] [--out FILE]
--short: one round of kill-leader, kill-follower, stop-leader, partition-leader, clock-jump,
rescale, disk-full-follower, disk-full-leader, power-loss and power-loss-disk, shorter gaps (about 3 minutes for both servers on 2 cores).
--faults: this schedule instead (e.g. power-loss-disk,power-loss-disk,power-loss-disk).
--check-disks: only the disk self-check (exit 1 if it fails).
"""

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_common  # noqa: E402
from cluster_common import (  # noqa: E402
    KEEL,
    NATS,
    api,
    clock_unavailable,
    Cluster,
    connect,
    create_stream,
    disk_selfcheck,
    disks_unavailable,
    replicas_current,
    stream_info,
    wait_stream_leader,
    report,
)

STREAM = "JEP"
CONSUMER_BUDGET = 240  # seconds for the whole consumer part


class Recorder:
    def __init__(self):
        self.acked = {}  # payload -> seq
        self.unknown = set()
        self.errors = {}
        self.attempts = 0
        self.order = {}  # publisher -> list of payloads in publish order


async def publisher(cl, idx, rec, stop, timeout):
    nc = await connect(cl.urls(idx % 3))
    js = nc.jetstream(timeout=timeout)
    i = 0
    seq_list = rec.order.setdefault(idx, [])
    while not stop.is_set():
        payload = f"p{idx}-{i}"
        i += 1
        rec.attempts += 1
        seq_list.append(payload)
        try:
            ack = await js.publish(f"jep.{idx}", payload.encode(), timeout=timeout)
            rec.acked[payload] = ack.seq
        except Exception as e:  # noqa: BLE001 - every failure is an unknown outcome
            rec.unknown.add(payload)
            k = type(e).__name__
            rec.errors[k] = rec.errors.get(k, 0) + 1
            await asyncio.sleep(0.05)
    try:
        await nc.close()
    except Exception:  # noqa: BLE001
        pass


# The stream's Raft group, as the last STREAM.INFO named it (for bitflip-follower).
group_of = {}


async def find_roles(cl, timeout=60):
    nc = await connect(cl.urls())
    try:
        info = await wait_stream_leader(nc, STREAM, timeout)
    finally:
        await nc.close()
    c = info["cluster"]
    group_of["group"] = c.get("raft_group", "")
    return c["leader"], [r["name"] for r in c.get("replicas", [])]


def flip_bits(store, parts, n):
    """Flips one bit at each of n random places of the regular files under `store` whose
    path names one of `parts`, each file chosen with a weight of its size."""
    files = []
    for root, _, names in os.walk(store):
        for f in names:
            p = os.path.join(root, f)
            if any(x and x in p for x in parts) and os.path.getsize(p) > 0:
                files.append(p)
    out = []
    if not files:
        return out
    sizes = [os.path.getsize(p) for p in files]
    for _ in range(n):
        p = random.choices(files, weights=sizes)[0]
        size = os.path.getsize(p)
        off = random.randrange(size)
        bit = random.randrange(8)
        with open(p, "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)[0]
            fh.seek(off)
            fh.write(bytes([b ^ (1 << bit)]))
        out.append(f"{os.path.relpath(p, store)}@{off} bit {bit}")
    return out


def log(t0, msg, sched):
    line = f"  t={time.monotonic() - t0:6.1f}s  {msg}"
    print(line, flush=True)
    sched.append(line)


async def partition(cl, fault, leader, replicas, hold, t0, sched):
    """One partition fault (see the docstring); logs what the cut-off side and the
    majority saw, which shows the cut was real."""
    px = cl.proxy
    lead = cl.by_name(leader)
    other = cl.by_name(random.choice(replicas)) if replicas else None
    if fault == "bridge":
        if other is None:
            log(t0, "bridge: no replica known, skipped", sched)
            return
        third = [n.name for n in cl.nodes if n not in (lead, other)]
        cut = px.cut([(lead.idx, other.idx)])
        what = f"bridge: cut {lead.name} <-> {other.name}, both reach {', '.join(third)}"
        # Asked through the node that reaches both: a client on the one cut off from the
        # leader gets no answer (only the leader answers STREAM.INFO, on both servers), which
        # read as "no leader" although the leader and the third node went on.
        asked = [n for n in cl.nodes if n not in (lead, other)] + [lead, other]
        x = None
    else:
        x = lead if fault == "partition-leader" else other
        if x is None:
            log(t0, f"{fault}: no replica known, skipped", sched)
            return
        cut = px.isolate(x.idx)
        role = "leader" if x is lead else "follower"
        what = f"partition: {role} {x.name} cut off from both others"
        asked = [n for n in cl.nodes if n is not x]
    direct = ", ".join(cl.direct_routes()) or "none"
    done = "frozen" if px.mode == "hang" else "closed"
    log(t0, f"{what} for {hold}s ({cut} route connections {done}; bypassing the proxy: {direct})", sched)
    t = time.monotonic()
    names = ", ".join(n.name for n in asked)
    nc = await connect([n.url for n in asked])
    try:
        try:
            if x is lead:
                info = await wait_stream_leader(nc, STREAM, hold + 30, not_=lead.name)
            else:
                await asyncio.sleep(hold)
                info = await wait_stream_leader(nc, STREAM, 10)
            now = info["cluster"]["leader"]
            seen = f"stream leader per {names}: {now} (was {leader}) after {time.monotonic() - t:.1f}s"
        except RuntimeError:
            none = "NO new stream leader" if x is lead else "NO stream leader"
            seen = f"{none} per {names} after {time.monotonic() - t:.1f}s"
            if cl.kind == "keel":
                seen += f"; Raft per node: {raft_states(cl)}"
        if x is not None:
            # What the cut-off node says (its clients are not partitioned).
            xc = await connect([x.url], max_reconnect_attempts=1)
            try:
                xi = await stream_info(xc, STREAM, 2)
                seen += f"; {x.name} itself says leader {xi.get('cluster', {}).get('leader')!r}"
            except Exception as e:  # noqa: BLE001 - a cut-off node may not answer at all
                seen += f"; {x.name} itself: {type(e).__name__}"
            finally:
                await xc.close()
        log(t0, seen, sched)
        await asyncio.sleep(max(0.0, hold - (time.monotonic() - t)))
    finally:
        await nc.close()
        px.heal()
    held = "held" if px.mode == "hang" else "refused"
    log(t0, f"healed ({px.stats[held]} new connections {held} while cut, so far)", sched)


def raft_states(cl):
    """Each keel node's view of the stream's Raft group from its /metrics (role 0 learner,
    1 follower, 2 candidate, 3 leader; term; last log and applied index; on a leader, ms
    since a quorum confirmed it): for a fault that leaves the stream without a leader."""
    keys = {
        "keel_raft_group_state": "role",
        "keel_raft_group_term": "term",
        "keel_raft_group_last_log_index": "last",
        "keel_raft_group_applied_index": "applied",
        "keel_raft_group_quorum_ack_age_milliseconds": "quorum_ack_ms",
    }
    out = []
    for n in cl.nodes:
        if not n.alive() or n.stopped:
            continue
        try:
            url = f"http://127.0.0.1:{n.hport}/metrics"
            with urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode()
        except Exception as e:  # noqa: BLE001 - a node that does not answer
            out.append(f"{n.name} ({type(e).__name__})")
            continue
        vals = []
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in keys and f'stream_name="{STREAM}"' in line:
                vals.append(f"{keys[name]}={line.rsplit(' ', 1)[-1]}")
        out.append(f"{n.name} {' '.join(vals)}")
    return "; ".join(out)


async def run_schedule(cl, faults, args, t0, sched):
    loop = asyncio.get_running_loop()
    gap, down, stop_s = args.gap, args.down, args.stop
    # After 60 s with no stream leader (the reference lost its stream at a power cut), the
    # next faults look for one for 10 s only, rather than a minute each.
    wait = 60
    for f in faults:
        await asyncio.sleep(gap)
        if args.storage == "memory":
            # A killed memory replica comes back empty: the next fault waits until it has
            # been refilled, so that no fault takes the last full copy.
            _, took = await converge(cl, 60, lag_ok=True)
            if took is None:
                log(t0, f"replicas NOT current within 60 s before {f}", sched)
            elif took > 0.5:
                log(t0, f"replicas current after {took:.1f}s", sched)
        try:
            leader, replicas = await find_roles(cl, wait)
            wait = 60
        except RuntimeError:
            # No stream leader (seen on the reference after a power cut): a fault that
            # needs the roles is skipped, the power losses still run.
            log(t0, f"NO stream leader in {wait} s before {f}", sched)
            wait = 10
            if not f.startswith("power-loss"):
                log(t0, f"{f}: skipped", sched)
                continue
        if f in ("kill-leader", "kill-follower"):
            if f == "kill-leader":
                role, name = "leader", leader
            else:
                role, name = "follower", random.choice(replicas) if replicas else leader
            n = cl.by_name(name)
            n.kill()
            log(t0, f"SIGKILL {role} {name}", sched)
            await asyncio.sleep(down)
            n.start()
            await loop.run_in_executor(None, n.wait_port)
            log(t0, f"restarted {name}", sched)
        elif f == "bitflip-follower":
            name = random.choice(replicas) if replicas else leader
            n = cl.by_name(name)
            n.kill()
            flipped = flip_bits(n.store, [STREAM, group_of.get("group", "")], args.flips)
            log(t0, f"SIGKILL follower {name}, flipped {'; '.join(flipped) or 'nothing'}", sched)
            await asyncio.sleep(down)
            n.start()
            await loop.run_in_executor(None, n.wait_port)
            log(t0, f"restarted {name}", sched)
        elif f == "stop-leader":
            n = cl.by_name(leader)
            n.sigstop()
            log(t0, f"SIGSTOP leader {leader} for {stop_s}s", sched)
            await asyncio.sleep(stop_s)
            n.sigcont()
            log(t0, f"SIGCONT {leader}", sched)
        elif f in ("power-loss", "power-loss-disk"):
            cl.kill_all()
            if f == "power-loss-disk" and cl.disks:
                t = time.monotonic()
                during = await loop.run_in_executor(None, cl.power_cut, args.keep)
                took = time.monotonic() - t
                log(
                    t0,
                    f"POWER CUT: SIGKILL all three, disk images copied and mounted in place of "
                    f"the originals in {took:.1f}s ({during} sectors written during the copies)",
                    sched,
                )
            else:
                took = 0.0
                how = ", no disk mode" if f == "power-loss-disk" else ""
                log(t0, f"SIGKILL all three (power loss as a process kill{how})", sched)
            await asyncio.sleep(max(0.0, down - took))
            for n in cl.nodes:
                n.start()
            for n in cl.nodes:
                await loop.run_in_executor(None, n.wait_port)
            log(t0, "restarted all three", sched)
        elif f in ("partition-leader", "partition-follower", "bridge"):
            await partition(cl, f, leader, replicas, args.partition, t0, sched)
        elif f == "rescale":
            await rescale(cl, gap, t0, sched)
        elif f == "clock-jump":
            await clock_jump(cl, leader, replicas, args, t0, sched)
        elif f in ("disk-full-leader", "disk-full-follower"):
            await disk_full(cl, f, leader, replicas, args, t0, sched)
        else:
            raise ValueError(f"unknown fault {f}")
    await asyncio.sleep(gap)


def fill_disk(path):
    """Takes every free block of the filesystem at `path` (root's reserve too: the servers
    run as root) with two files under it; returns the bytes taken."""
    st = os.statvfs(path)
    free = st.f_bfree * st.f_frsize
    taken = 0
    fd = os.open(os.path.join(path, ".filler"), os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        want = max(0, free - (8 << 20))
        while want > 0:
            try:
                os.posix_fallocate(fd, 0, want)
                taken = want
                break
            except OSError:
                want -= 4 << 20
    finally:
        os.close(fd)
    # The rest (what the big file's own metadata left) written until the disk says no.
    fd = os.open(os.path.join(path, ".filler2"), os.O_CREAT | os.O_WRONLY, 0o600)
    chunk = b"\0" * (64 << 10)
    try:
        while True:
            n = os.write(fd, chunk)
            taken += n
            if n < len(chunk):
                break
    except OSError:
        pass
    finally:
        os.close(fd)
    return taken


def free_disk(path):
    for name in (".filler", ".filler2"):
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass


async def disk_full(cl, fault, leader, replicas, args, t0, sched):
    """The disk-full faults (see the docstring)."""
    if not cl.disks:
        log(t0, f"{fault}: skipped (disk mode off)", sched)
        return
    role = "leader" if fault == "disk-full-leader" else "follower"
    name = leader if role == "leader" else (random.choice(replicas) if replicas else leader)
    n = cl.by_name(name)
    loop = asyncio.get_running_loop()
    taken = await loop.run_in_executor(None, fill_disk, n.store)
    log(t0, f"DISK FULL on {role} {name} ({taken >> 20} MiB taken) for {args.stop}s", sched)
    await asyncio.sleep(args.stop)
    try:
        now, _ = await find_roles(cl, 10)
        seen = f"stream leader {now}"
    except RuntimeError:
        seen = "NO stream leader"
    free_disk(n.store)
    log(t0, f"disk space back on {name} ({seen} while full)", sched)
    _, took = await converge(cl, 60, lag_ok=True)
    if took is None:
        # Keel's promise: a replica comes back by itself once there is space (a verdict).
        cl.not_recovered = getattr(cl, "not_recovered", 0) + 1
        log(t0, f"replicas NOT current within 60 s after {name}'s disk was freed", sched)
    else:
        log(t0, f"replicas current {took:.1f}s after {name}'s disk was freed", sched)


async def clock_jump(cl, leader, replicas, args, t0, sched):
    """The clock-jump fault (see the docstring)."""
    if not cl.clocks:
        log(t0, f"clock-jump: skipped ({cl.clock_why})", sched)
        return
    loop = asyncio.get_running_loop()
    lead = cl.by_name(leader)
    other = cl.by_name(random.choice(replicas)) if replicas else None
    ahead = await loop.run_in_executor(None, lead.set_clock, 7200)
    what = f"clock: leader {leader} stepped {ahead:+.0f}s"
    if other is not None:
        behind = await loop.run_in_executor(None, other.set_clock, -3600)
        what += f", follower {other.name} {behind:+.0f}s"
    log(t0, what, sched)
    await asyncio.sleep(args.stop)
    victim = lead
    if other is not None:
        # Leadership to the server whose clock is behind: its messages follow ones
        # stamped three hours later.
        how = await lead_by_stepdown(cl, other)
        log(t0, f"stepdown to {other.name}: {how}", sched)
        try:
            victim = cl.by_name((await find_roles(cl))[0])
        except RuntimeError:
            pass  # No leader: the old one is killed anyway.
        await asyncio.sleep(args.stop)
    victim.kill()
    log(t0, f"SIGKILL leader {victim.name} (clock {victim.offset:+d}s)", sched)
    await asyncio.sleep(args.down)
    victim.start()
    await loop.run_in_executor(None, victim.wait_port)
    try:
        now, _ = await find_roles(cl)
        seen = f"stream leader now {now} (clock {cl.by_name(now).offset:+d}s)"
    except RuntimeError:
        seen = "NO stream leader in 60 s"
    log(t0, f"restarted {victim.name}; {seen}", sched)
    await asyncio.sleep(args.gap)
    for n in (lead, other):
        if n is not None:
            await loop.run_in_executor(None, n.set_clock, 0)
    log(t0, "clocks stepped back to the true time", sched)


async def rescale(cl, gap, t0, sched):
    """The stream to R1, publishing on for `gap` seconds, then back to R3 and current."""
    nc = await connect(cl.urls())
    try:
        cfg = (await stream_info(nc, STREAM, 10))["config"]
        for r in (1, 3):
            cfg["num_replicas"] = r
            t = time.monotonic()
            while True:
                try:
                    res = await api(nc, f"$JS.API.STREAM.UPDATE.{STREAM}", cfg, timeout=10)
                    err = res.get("error")
                except Exception as e:  # noqa: BLE001 - retried
                    err = repr(e)
                if not err:
                    break
                if time.monotonic() - t > 30:
                    log(t0, f"rescale: update to R{r} refused: {err}", sched)
                    return
                await asyncio.sleep(0.5)
            log(t0, f"stream updated to R{r}", sched)
            await asyncio.sleep(gap)
    finally:
        await nc.close()
    info, took = await converge(cl, 60)
    when = f"after {took:.1f}s" if took is not None else "NOT within 60s"
    log(t0, f"rescaled back: {said(info)}; replicas current {when}", sched)


def said(info):
    """What a STREAM.INFO answer says of the stream, for the timeline."""
    if not isinstance(info, dict) or "state" not in info:
        return "STREAM.INFO: no answer"
    st = info["state"]
    lead = info.get("cluster", {}).get("leader")
    return f"STREAM.INFO: {st.get('messages')} messages, last_seq {st.get('last_seq')}, leader {lead}"


async def converge(cl, timeout, lag_ok=False):
    """Wait until STREAM.INFO shows every replica current with no lag (best effort; with
    `lag_ok`, current is enough: under load some lag is always there)."""
    nc = await connect(cl.urls())
    t = time.monotonic()
    info = None
    try:
        while time.monotonic() - t < timeout:
            try:
                info = await stream_info(nc, STREAM, 2)
                if replicas_current(info, lag_ok=lag_ok):
                    return info, time.monotonic() - t
            except Exception:  # noqa: BLE001
                pass
            await asyncio.sleep(0.3)
    finally:
        await nc.close()
    return info, None


async def lead_with(cl, node, tries=10):
    """Moves the stream's leadership to `node` (all three up) by stopping the leader
    until `node` is elected; returns how many moves it took."""
    loop = asyncio.get_running_loop()
    for i in range(tries):
        leader, _ = await find_roles(cl)
        if leader == node.name:
            return f"{i} moves"
        old = cl.by_name(leader)
        old.term()
        nc = await connect([m.url for m in cl.nodes if m.alive()])
        try:
            await wait_stream_leader(nc, STREAM, 60, not_=leader)
        finally:
            await nc.close()
        old.start()
        await loop.run_in_executor(None, old.wait_port)
        await converge(cl, 30)
    return "NOT leader"


async def lead_by_stepdown(cl, node, tries=5):
    """Moves the stream's leadership to `node` (all three up) with STREAM.LEADER.STEPDOWN
    and placement.preferred; says how it went."""
    nc = await connect(cl.urls())
    errors = []
    try:
        for i in range(tries):
            info = await wait_stream_leader(nc, STREAM, 30)
            now = info["cluster"]["leader"]
            if now == node.name:
                return f"{i} stepdowns"
            body = {"placement": {"preferred": node.name}}
            r = await api(nc, f"$JS.API.STREAM.LEADER.STEPDOWN.{STREAM}", body, timeout=15)
            if r.get("error"):
                errors.append(r["error"].get("description", str(r["error"])))
                await asyncio.sleep(1)  # e.g. not current yet
                continue
            try:
                await wait_stream_leader(nc, STREAM, 15, not_=now)
            except RuntimeError as e:
                errors.append(str(e)[:100])
        return f"NOT leader: {'; '.join(errors)}"
    finally:
        await nc.close()


async def read_alone(node, upto, timeout=60, stamps=None):
    """Every sequence 1..upto from `node`'s own store: seq -> payload (None if absent);
    `stamps` (a dict) gets seq -> the message's Nats-Time-Stamp."""
    nc = await connect([node.url], max_reconnect_attempts=5)
    out = {}
    t = time.monotonic()
    # A restarted lone node may take a moment to load its streams.
    while True:
        try:
            m = await nc.request(
                f"$JS.API.DIRECT.GET.{STREAM}", json.dumps({"seq": 1}).encode(), timeout=2
            )
            st = (m.headers or {}).get("Status")
            if st in (None, "404"):
                break
        except Exception:  # noqa: BLE001
            pass
        if time.monotonic() - t > timeout:
            await nc.close()
            return None
        await asyncio.sleep(0.3)

    async def one(seq):
        for _ in range(5):
            try:
                m = await nc.request(
                    f"$JS.API.DIRECT.GET.{STREAM}",
                    json.dumps({"seq": seq}).encode(),
                    timeout=5,
                )
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.2)
                continue
            h = m.headers or {}
            st = h.get("Status")
            if st is None:
                got = int(h.get("Nats-Sequence", seq))
                if got != seq:
                    return seq, ("WRONG-SEQ", got, m.data.decode()), None
                return seq, m.data.decode(), h.get("Nats-Time-Stamp")
            if st == "404":
                return seq, None, None
            await asyncio.sleep(0.2)
        return seq, ("NO-ANSWER",), None

    seqs = list(range(1, upto + 1))
    for i in range(0, len(seqs), 256):
        for seq, v, ts in await asyncio.gather(*(one(s) for s in seqs[i : i + 256])):
            out[seq] = v
            if stamps is not None and ts is not None:
                stamps[seq] = ts
    await nc.close()
    return out


def check(rec, reads, stamps=None):
    """reads: node name -> {seq: payload|None}; stamps: node name -> {seq: Nats-Time-Stamp}
    (a sequence must carry the same time on every replica: the leader's, in its entry).
    Returns a dict of counts and examples."""
    res = {"lost": 0, "divergent": 0, "order": 0, "foreign": 0, "unreadable": 0}
    ex = {k: [] for k in res}
    attempted = set()
    for lst in rec.order.values():
        attempted.update(lst)
    missing = {}  # payload -> replicas it is missing from
    for name, r in reads.items():
        if r is None:
            res["unreadable"] += 1
            ex["unreadable"].append(f"{name}: did not answer direct gets alone")
            continue
        for payload, seq in rec.acked.items():
            got = r.get(seq)
            if got != payload:
                res["lost"] += 1
                missing[payload] = missing.get(payload, 0) + 1
                if len(ex["lost"]) < 5:
                    ex["lost"].append(f"{name}: acked {payload}@{seq}, has {got!r}")
        where = {}
        for seq, p in r.items():
            if p is None:
                continue
            if not isinstance(p, str):
                res["foreign"] += 1
                ex["foreign"].append(f"{name}: seq {seq}: {p}")
                continue
            if p not in attempted and not p.startswith("c-"):
                res["foreign"] += 1
                if len(ex["foreign"]) < 5:
                    ex["foreign"].append(f"{name}: seq {seq} holds unpublished {p!r}")
            if p in where:
                res["foreign"] += 1
                if len(ex["foreign"]) < 5:
                    ex["foreign"].append(f"{name}: {p!r} at seq {where[p]} and {seq}")
            where[p] = seq
        for pub, lst in rec.order.items():
            last = 0
            for p in lst:
                s = where.get(p)
                if s is None:
                    continue
                if s < last:
                    res["order"] += 1
                    if len(ex["order"]) < 5:
                        ex["order"].append(f"{name}: {p} at {s} after seq {last}")
                last = max(last, s)
    names = [n for n, r in reads.items() if r is not None]
    # The table's count is per replica; these are the distinct acked writes.
    res["lost_some"] = len(missing)
    res["lost_every"] = sum(1 for c in missing.values() if names and c == len(names))
    seqs = set()
    for n in names:
        seqs.update(s for s, p in reads[n].items() if p is not None)
    for s in sorted(seqs):
        vals = {reads[n].get(s) for n in names}
        vals.discard(None)
        if len(vals) > 1:
            res["divergent"] += 1
            if len(ex["divergent"]) < 5:
                ex["divergent"].append(f"seq {s}: {sorted(map(str, vals))}")
            continue
        times = {(stamps or {}).get(n, {}).get(s) for n in names}
        times.discard(None)
        if len(times) > 1:
            res["divergent"] += 1
            if len(ex["divergent"]) < 5:
                ex["divergent"].append(f"seq {s}: times {sorted(times)}")
    return res, ex


def steps_back(stamps):
    """How often a message's time is earlier than the one before it in the stream, and the
    largest such step in seconds (a clock stepped back on a leader shows here)."""
    n, most, last = 0, 0.0, None
    for seq in sorted(stamps):
        t = cluster_common.parse_rfc3339(stamps[seq])
        if last is not None and t < last:
            n += 1
            most = max(most, last - t)
        last = t
    return n, most


async def consumer_part(cl, msgs, t0, sched):
    """A durable pull consumer, AckSync acks, its server killed mid-way."""
    conns = []
    try:
        return await _consumer_part(cl, msgs, t0, sched, conns)
    finally:
        for c in conns:
            try:
                await asyncio.wait_for(c.close(), 5)
            except Exception:  # noqa: BLE001
                pass


async def _consumer_part(cl, msgs, t0, sched, conns):
    nc = await connect(cl.urls())
    conns.append(nc)
    js = nc.jetstream(timeout=5)
    body = {
        "stream_name": STREAM,
        "config": {
            "durable_name": "W",
            "ack_policy": "explicit",
            "deliver_policy": "all",
            "filter_subject": "jep.c",
            "ack_wait": 5_000_000_000,
            # No num_replicas: it inherits the stream's R3 on both servers (keel
            # refuses an explicit 3, see the report).
        },
    }
    # Right after the fault schedule either server may still be settling: retry.
    t = time.monotonic()
    while True:
        try:
            r = await api(nc, f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.W", body, timeout=10)
            if "error" not in r:
                break
            err = r["error"]
        except Exception as e:  # noqa: BLE001
            err = repr(e)
        if time.monotonic() - t > 60:
            raise RuntimeError(f"consumer create: {err}")
        await asyncio.sleep(1)
    for i in range(msgs):
        for _ in range(10):
            try:
                await js.publish("jep.c", f"c-{i}".encode(), timeout=10)
                break
            except Exception:  # noqa: BLE001 - a retry may store it twice: counted by seq
                await asyncio.sleep(0.5)
    await nc.close()

    confirmed = set()
    deliveries = []  # (stream_seq, redelivered?)
    problems = {"redelivered_after_confirmed_ack": 0, "out_of_order": 0}
    killed = None  # the node killed, until it is restarted
    killed_at = None
    nc = await connect(cl.urls(1))
    conns.append(nc)
    js = nc.jetstream(timeout=5)
    sub = await js.pull_subscribe_bind("W", STREAM)
    t = time.monotonic()
    highest_new = 0
    total = msgs
    while len(confirmed) < total and time.monotonic() - t < 120:
        if killed_at is None and len(confirmed) >= total // 2:
            leader, _ = await find_roles(cl)
            killed = cl.by_name(leader)
            killed.kill()
            killed_at = time.monotonic()
            log(t0, f"consumer: SIGKILL stream/consumer leader {leader}", sched)
        if killed is not None and time.monotonic() - killed_at > 3:
            killed.start()
            log(t0, f"consumer: restarted {killed.name}", sched)
            killed = None
        try:
            batch = await sub.fetch(50, timeout=2)
        except Exception:  # noqa: BLE001 - timeouts while the consumer moves
            continue
        for m in batch:
            s = m.metadata.sequence.stream
            red = m.metadata.num_delivered > 1
            deliveries.append((s, red))
            if s in confirmed:
                problems["redelivered_after_confirmed_ack"] += 1
            if not red and s < highest_new:
                problems["out_of_order"] += 1
            if not red:
                highest_new = max(highest_new, s)
            try:
                await m.ack_sync(timeout=3)
                confirmed.add(s)
            except Exception:  # noqa: BLE001 - outcome unknown: may be redelivered
                pass
    if killed is not None:
        killed.start()
    await nc.close()
    return {
        "messages": total,
        "confirmed_acks": len(confirmed),
        "deliveries": len(deliveries),
        "redeliveries": sum(1 for _, r in deliveries if r),
        **problems,
    }


async def run_one(kind, binary, args, faults):
    print(f"\n== {kind}: {binary}", flush=True)
    sched = []
    res = {"kind": kind}
    clock_why = clock_unavailable(binary) if "clock-jump" in faults else "not in the schedule"
    clocks = clock_why is None
    try:
        cl = Cluster(
            kind, binary, base=args.dir, partitions=args.partition_mode, disks=args.use_disks, clocks=clocks
        )
    except RuntimeError as e:
        if args.disks == "on" or not args.use_disks:
            raise
        # auto: carry on without disk mode (power-loss-disk becomes a process kill)
        msg = f"disk mode off for {kind}: {e}"
        print(msg, flush=True)
        sched.append(f"  {msg}")
        cl = Cluster(kind, binary, base=args.dir, partitions=args.partition_mode, clocks=clocks)
    cl.clock_why = clock_why
    try:
        cl.start()
        cl.wait_meta()
        nc = await connect(cl.urls())
        await create_stream(
            nc,
            {
                "name": STREAM,
                "subjects": ["jep.>"],
                "storage": args.storage,
                "num_replicas": 3,
                "allow_direct": True,
            },
        )
        await nc.close()
        rec = Recorder()
        stop = asyncio.Event()
        t0 = time.monotonic()
        pubs = [
            asyncio.create_task(publisher(cl, i, rec, stop, args.timeout))
            for i in range(args.pubs)
        ]
        await run_schedule(cl, faults, args, t0, sched)
        stop.set()
        await asyncio.gather(*pubs, return_exceptions=True)
        log(t0, f"publishers stopped: {len(rec.acked)} acked, {len(rec.unknown)} unknown", sched)
        info, took = await converge(cl, 30)
        log(t0, f"converged: {'yes in %.1fs' % took if took is not None else 'NO (30 s)'}; {said(info)}", sched)
        last = (info or {}).get("state", {}).get("last_seq", 0) if info else 0
        if args.consumer:
            try:
                # Bounded: its retries could take hours on a cluster that lost its stream.
                part = consumer_part(cl, args.consumer, t0, sched)
                res["consumer"] = await asyncio.wait_for(part, CONSUMER_BUDGET)
            except asyncio.TimeoutError:
                res["consumer"] = {"error": f"not done in {CONSUMER_BUDGET} s"}
                log(t0, f"consumer: not done in {CONSUMER_BUDGET} s, abandoned", sched)
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                res["consumer"] = {"error": repr(e)}
            info, took = await converge(cl, 30)
            log(t0, f"converged: {'yes in %.1fs' % took if took is not None else 'NO (30 s)'}; {said(info)}", sched)
        upto = max([last, *rec.acked.values(), 0]) + len(rec.unknown) + args.consumer + 10
        reads = {}
        stamps = {n.name: {} for n in cl.nodes}
        pending = []
        if args.storage == "memory":
            # A memory replica keeps nothing through a restart: each is read while it leads,
            # all three up (a leader answers direct gets from its own store).
            await converge(cl, 60)
            for n in cl.nodes:
                how = await lead_by_stepdown(cl, n)
                reads[n.name] = await read_alone(n, upto, 30, stamps[n.name])
                present = sum(1 for v in (reads[n.name] or {}).values() if v is not None)
                log(t0, f"read {n.name} as stream leader ({how}): {present} messages", sched)
        cl.stop()
        for n in cl.nodes if args.storage != "memory" else []:
            n.start()
            n.wait_port()
            reads[n.name] = await read_alone(n, upto, args.alone_wait, stamps[n.name])
            n.term()
            if reads[n.name] is None:
                pending.append(n)
                log(t0, f"{n.name} alone: no direct-get answer in {args.alone_wait}s", sched)
                continue
            present = sum(1 for v in reads[n.name].values() if v is not None)
            log(t0, f"read {n.name} alone: {present} messages", sched)
        if pending:
            # A lone follower does not answer direct gets (the reference enables them on
            # a follower only once it is current, which needs a leader; keel forwards them
            # to the stream leader). So each such node is read while it LEADS the stream,
            # all three up: the leader answers from its own store on both servers. Leadership
            # is moved by stopping (SIGTERM) the leader until the node wanted is elected.
            cl.start()
            led = 0
            try:
                cl.wait_meta()
                await converge(cl, 60)
                for n in pending:
                    how = await lead_with(cl, n)
                    reads[n.name] = await read_alone(n, upto, 30, stamps[n.name])
                    led += reads[n.name] is not None
                    present = sum(1 for v in (reads[n.name] or {}).values() if v is not None)
                    log(t0, f"read {n.name} as stream leader ({how}), all up: {present} messages", sched)
            except RuntimeError as e:  # no meta or stream leader: the rest stay unreadable
                log(t0, f"cannot read the other replicas: {str(e)[:200]}", sched)
                if "10059" in str(e) or "stream not found" in str(e):
                    # The meta leader says the stream no longer exists (the reference
                    # after a power cut): its replicas hold none of it, so every acked
                    # write counts as lost on each, not as an unreadable replica.
                    gone = [n.name for n in pending if reads[n.name] is None]
                    for name in gone:
                        reads[name] = {}
                    res["stream_gone"] = True
                    log(t0, f"stream {STREAM} NOT FOUND per the meta leader: {', '.join(gone)} count as empty", sched)
            cl.stop()
        if args.storage == "memory":
            res["read_mode"] = "each leading"
        elif not pending:
            res["read_mode"] = "alone"
        elif res.get("stream_gone"):
            res["read_mode"] = "STREAM GONE"
        else:
            res["read_mode"] = f"{3 - len(pending)} alone, {led} as leader"
        counts, ex = check(rec, reads, stamps)
        if "clock-jump" in faults:
            read = [st for st in stamps.values() if st]
            if read:
                n, most = steps_back(read[0])
                log(t0, f"message times stepping back in the stream: {n} (largest {most:.0f}s)", sched)
        res.update(
            attempts=rec.attempts,
            acked=len(rec.acked),
            unknown=len(rec.unknown),
            unknown_present=len(
                rec.unknown & {p for r in reads.values() for p in (r or {}).values()}
            ),
            errors=rec.errors,
            not_recovered=getattr(cl, "not_recovered", 0),
            schedule=sched,
            examples={k: v for k, v in ex.items() if v},
            **counts,
        )
    finally:
        cl.cleanup(keep=args.keep)
    return res


def table(rows):
    k, n = rows
    keys = [
        ("publish attempts", "attempts"),
        ("acked writes", "acked"),
        ("unknown outcome", "unknown"),
        ("  of which in the stream", "unknown_present"),
        ("LOST acked writes", "lost"),
        ("DIVERGENT sequences", "divergent"),
        ("ORDER violations", "order"),
        ("FOREIGN/duplicate payloads", "foreign"),
        ("replicas unreadable", "unreadable"),
        ("replicas read", "read_mode"),
    ]
    out = [f"{'':30} {'keel':>10} {'nats-server':>12} {'keel/ref':>9}"]
    for label, key in keys:
        a, b = k.get(key, "-"), n.get(key, "-")
        ratio = f"{a / b:.2f}" if isinstance(a, int) and isinstance(b, int) and b else "-"
        out.append(f"{label:30} {a!s:>10} {b!s:>12} {ratio:>9}")
    if "consumer" in k or "consumer" in n:
        kc, ncn = k.get("consumer", {}), n.get("consumer", {})
        out.append("consumer (AckSync, leader killed mid-way):")
        for key in (
            "messages",
            "confirmed_acks",
            "deliveries",
            "redeliveries",
            "redelivered_after_confirmed_ack",
            "out_of_order",
            "error",
        ):
            if key in kc or key in ncn:
                out.append(f"  {key:28} {kc.get(key, '-')!s:>10} {ncn.get(key, '-')!s:>12}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="one round of each kind of fault (about 3 minutes for both servers)")
    ap.add_argument("--pubs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the schedule (long mode)")
    ap.add_argument("--gap", type=float, default=None, help="seconds of publishing between faults")
    ap.add_argument("--down", type=float, default=2.0, help="seconds a killed node stays down")
    ap.add_argument("--stop", type=float, default=None, help="seconds of SIGSTOP")
    ap.add_argument("--flips", type=int, default=1, help="bits flipped per bitflip-follower")
    ap.add_argument("--timeout", type=float, default=2.0, help="PubAck timeout")
    ap.add_argument("--partition", type=float, default=None, help="seconds a partition lasts (at least)")
    ap.add_argument(
        "--partition-mode",
        choices=["close", "hang"],
        default="close",
        help="a cut link closes its connections, or freezes them until healed",
    )
    ap.add_argument("--no-power-loss", action="store_true", help="leave out power-loss and power-loss-disk")
    ap.add_argument("--faults", default=None, help="comma-separated fault schedule, instead of the default")
    ap.add_argument(
        "--disks",
        choices=["auto", "on", "off"],
        default="auto",
        help="disk mode for power-loss-disk (auto: on if possible, else a process kill)",
    )
    ap.add_argument("--check-disks", action="store_true", help="only run the disk self-check")
    ap.add_argument(
        "--disk-window",
        type=int,
        default=cluster_common.DISK_COMMIT_S,
        help="disk mode: ext4 commit interval and dirty page expiry, seconds (the most a power cut can lose)",
    )
    ap.add_argument("--consumer", type=int, default=None, help="messages for the consumer part (0: skip)")
    ap.add_argument("--only", choices=["keel", "nats"])
    ap.add_argument(
        "--storage",
        choices=["file", "memory"],
        default="file",
        help="the R3 stream's storage (memory: only faults that leave a quorum's memory)",
    )
    ap.add_argument("--dir", default=None, help="parent of the store directories")
    ap.add_argument("--keep", action="store_true", help="keep stores and logs")
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("--alone-wait", type=float, default=8.0, help="seconds a lone node gets to answer")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    random.seed(args.seed)
    cluster_common.DISK_COMMIT_S = args.disk_window
    # SIGTERM unwinds like Ctrl-C, so cleanup() unmounts the disks and restores the sysctl.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.check_disks:
        why = disks_unavailable()
        if why:
            print(f"disk mode unavailable: {why}")
            sys.exit(1)
        ok, text = disk_selfcheck(args.dir)
        print(text)
        sys.exit(0 if ok else 1)
    power = [] if args.no_power_loss else ["power-loss", "power-loss-disk"]
    if args.short:
        faults = ["kill-leader", "kill-follower", "stop-leader", "partition-leader", "clock-jump"]
        faults += ["rescale", "disk-full-follower", "disk-full-leader"]
        faults += power
        args.gap = args.gap if args.gap is not None else 1.5
        args.stop = args.stop if args.stop is not None else 5.0
        args.partition = args.partition if args.partition is not None else 4.0
        args.consumer = 100 if args.consumer is None else args.consumer
        args.alone_wait = min(args.alone_wait, 3.0)
    else:
        base = ["kill-leader", "kill-follower", "stop-leader"]
        base += ["partition-leader", "partition-follower", "bridge", "clock-jump", "rescale"]
        base += ["disk-full-follower", "disk-full-leader", *power]
        faults = base * args.rounds
        args.gap = args.gap if args.gap is not None else 5.0
        args.stop = args.stop if args.stop is not None else 12.0
        args.partition = args.partition if args.partition is not None else 10.0
        args.consumer = 2000 if args.consumer is None else args.consumer
    # What a memory stream cannot survive by design (or has no files for).
    not_memory = {"power-loss", "power-loss-disk", "bitflip-follower", "disk-full-leader", "disk-full-follower"}
    if args.storage == "memory":
        faults = [f for f in faults if f not in not_memory]
    if args.faults:
        faults = [f.strip() for f in args.faults.split(",") if f.strip()]
        if args.storage == "memory" and not_memory & set(faults):
            ap.error(f"not with --storage memory: {', '.join(sorted(not_memory & set(faults)))}")
        known = {"kill-leader", "kill-follower", "stop-leader", "power-loss", "power-loss-disk"}
        known |= {"partition-leader", "partition-follower", "bridge", "rescale", "bitflip-follower"}
        known |= {"clock-jump", "disk-full-leader", "disk-full-follower"}
        bad = [f for f in faults if f not in known]
        if bad:
            ap.error(f"unknown fault(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    started = time.time()
    args.use_disks = False
    disk_line = "disk mode: not used (no power-loss-disk in the schedule)"
    if {"power-loss-disk", "disk-full-leader", "disk-full-follower"} & set(faults):
        why = "--disks off" if args.disks == "off" else disks_unavailable()
        if why is None:
            try:
                ok, disk_line = disk_selfcheck(args.dir)
            except Exception as e:  # noqa: BLE001 - e.g. no free loop device
                ok, disk_line = False, f"disk self-check error: {e}"
            print(disk_line, flush=True)
            why = None if ok else "the self-check failed"
        if why is None:
            args.use_disks = True
            disk_line = (
                f"power-loss-disk: a power cut (stores on loop ext4 images, commit={args.disk_window}s, "
                f"dirty expiry {args.disk_window}s); {disk_line}"
            )
        elif args.disks == "on":
            print(f"--disks on, but disk mode is unavailable: {why}", file=sys.stderr)
            sys.exit(2)
        else:
            disk_line = f"disk mode OFF ({why}): power-loss-disk ran as power-loss, a process kill"
            print(disk_line, flush=True)
    results = {}
    for kind, binary in (("keel", KEEL), ("nats", NATS)):
        if args.only and args.only != kind:
            results[kind] = {}
            continue
        results[kind] = asyncio.run(run_one(kind, binary, args, faults))
    lines = [
        f"cluster_faults.py {' '.join(sys.argv[1:])} "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        f"3 separate processes per server, R3 {args.storage} stream, {args.pubs} publishers (PubAck "
        f"timeout {args.timeout}s), gap {args.gap}s, down {args.down}s, SIGSTOP {args.stop}s, "
        f"partition {args.partition}s ({args.partition_mode})",
        (
            "keel: acks after a quorum fsynced; nats-server: default lazy fsync (sync_interval 2m)."
            if args.storage == "file"
            else "both: acks once a quorum holds the message in memory."
        ),
        "power-loss is SIGKILL of all three at once: the page cache survives, so unsynced",
        "writes are not lost by it on either server.",
        disk_line,
        f"fault schedule: {', '.join(faults)}",
    ]
    for kind in ("keel", "nats"):
        r = results[kind]
        if not r:
            continue
        lines.append(f"\n{kind} timeline:")
        lines += r.get("schedule", [])
        if r.get("errors"):
            lines.append(f"  publish errors: {r['errors']}")
        if r.get("lost"):
            lines.append(
                f"  LOST: {r['lost_some']} distinct acked writes missing from some replica, "
                f"{r['lost_every']} from every replica read (of {r['acked']} acked)"
            )
        for k, v in r.get("examples", {}).items():
            lines.append(f"  {k} examples: " + "; ".join(v))
    lines.append("")
    lines.append(table([results["keel"], results["nats"]]))
    report(lines, args.out)
    # Keel's safety properties are the checker's verdict (the reference's are reported).
    k = results["keel"]
    kc = k.get("consumer", {}) if k else {}
    bad = [key for key in ("lost", "divergent", "order", "foreign") if k and k.get(key)]
    if k and k.get("not_recovered"):
        bad.append("not_recovered (a replica not current within 60 s of its disk freed)")
    bad += [key for key in ("redelivered_after_confirmed_ack", "out_of_order") if kc.get(key)]
    if bad:
        print(f"FAILED: keel {', '.join(bad)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
