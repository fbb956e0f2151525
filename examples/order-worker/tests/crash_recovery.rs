//! The worker is SIGKILLed between a committed write and its ack, restarted,
//! and every order still ends up processed exactly once; a SIGTERM drains and
//! exits 0; a later restart resumes after the last acknowledged message.
//!
//! The server is `$KEEL_TEST_SERVER_BIN` if set (`KEEL_TEST_SERVER_BIN=nats-server`
//! uses the one on PATH), else a built `keel-server` from this workspace's
//! target dir; it runs with JetStream (`-js -sd <tmpdir>`) on a free port.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const WORKER: &str = env!("CARGO_BIN_EXE_order-worker");
const DEADLINE: Duration = Duration::from_secs(30);

struct Server {
    child: Child,
    url: String,
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn server_binary() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("KEEL_TEST_SERVER_BIN") {
        return Some(PathBuf::from(bin));
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let built_here = Path::new(WORKER).parent().map(|d| d.join("keel-server"));
    built_here
        .into_iter()
        .chain(["debug", "release"].map(|p| workspace.join("target").join(p).join("keel-server")))
        .find(|p| p.is_file())
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "order-worker-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

fn start_server() -> Option<Server> {
    let Some(bin) = server_binary() else {
        eprintln!(
            "note: skipping, no server binary: build keel-server or set KEEL_TEST_SERVER_BIN"
        );
        return None;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port();
    let dir = temp_dir("js");
    // Readiness is this process's own "Listening" log line, not just an open port: another
    // test's server could briefly own the same port.
    let log_path = dir.with_extension("log");
    let log = std::fs::File::create(&log_path).expect("create server log");
    let child = Command::new(&bin)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let mut server = Server {
        child,
        url: format!("nats://127.0.0.1:{port}"),
        dir,
    };
    let start = Instant::now();
    let listening = || {
        std::fs::read_to_string(&log_path)
            .is_ok_and(|s| s.contains("Listening for client connections on"))
    };
    while !listening() || TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = server.child.try_wait().expect("poll server") {
            panic!("{} exited early with {status}", bin.display());
        }
        assert!(
            start.elapsed() < DEADLINE,
            "server did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Some(server)
}

/// A running worker with its stdout lines (processed orders) and stderr
/// lines (status) collected by threads.
struct Worker {
    child: Child,
    out: mpsc::Receiver<String>,
    err: mpsc::Receiver<String>,
    out_lines: Vec<String>,
}

fn spawn_worker(url: &str, db: &Path, crash_after: Option<u32>) -> Worker {
    let mut cmd = Command::new(WORKER);
    cmd.args(["--server", url, "--db"])
        .arg(db)
        // One message per pull, so "one message pending" is exact, and a
        // short ack wait so the redelivery after the crash comes quickly.
        .args(["--batch", "1", "--ack-wait", "2s"])
        .env_remove("ORDER_WORKER_CRASH_AFTER_WRITE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(n) = crash_after {
        cmd.env("ORDER_WORKER_CRASH_AFTER_WRITE", n.to_string());
    }
    let mut child = cmd.spawn().expect("spawn order-worker");
    let pipe = |r: Box<dyn std::io::Read + Send>| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        rx
    };
    let out = pipe(Box::new(child.stdout.take().unwrap()));
    let err = pipe(Box::new(child.stderr.take().unwrap()));
    let mut w = Worker {
        child,
        out,
        err,
        out_lines: Vec::new(),
    };
    w.wait_stderr("order-worker: ready");
    w
}

impl Worker {
    fn wait_stderr(&mut self, prefix: &str) -> String {
        let start = Instant::now();
        loop {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match self.err.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(_) => panic!("worker never printed {prefix:?}"),
            }
        }
    }

    /// Waits for the worker to exit by itself.
    fn wait_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("poll worker") {
                // Every line it wrote, up to the pipe's end (the reader thread may not
                // have passed them on yet when the exit is seen).
                while let Ok(line) = self.out.recv_timeout(DEADLINE) {
                    self.out_lines.push(line);
                }
                return s;
            }
            assert!(start.elapsed() < DEADLINE, "worker did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn sigterm(&mut self) -> ExitStatus {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        self.wait_exit()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn consumer_state(js: &async_nats::jetstream::Context) -> serde_json::Value {
    let reply = js
        .client()
        .request("$JS.API.CONSUMER.INFO.ORDERS.order-worker", "".into())
        .await
        .expect("consumer info");
    serde_json::from_slice(&reply.payload).expect("consumer info JSON")
}

async fn wait_until_done(js: &async_nats::jetstream::Context, acked_seq: u64) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let v = consumer_state(js).await;
        if v["ack_floor"]["stream_seq"].as_u64() == Some(acked_seq)
            && v["num_ack_pending"].as_u64() == Some(0)
            && v["num_pending"].as_u64() == Some(0)
        {
            return v;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "consumer never reached ack floor {acked_seq}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// (order_id, processed_count, deliveries, max_delivery) for every order.
fn rows(db: &Path) -> Vec<(String, i64, i64, i64)> {
    let conn = rusqlite::Connection::open(db).expect("open db");
    let mut stmt = conn
        .prepare(
            "SELECT order_id, processed_count, deliveries, max_delivery FROM orders \
             ORDER BY CAST(order_id AS INTEGER)",
        )
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

async fn publish_orders(js: &async_nats::jetstream::Context, ids: std::ops::RangeInclusive<u32>) {
    for id in ids {
        js.publish("orders.new", format!("{{\"id\":{id}}}").into())
            .await
            .expect("publish")
            .await
            .expect("publish ack");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_between_write_and_ack_processes_every_order_once() {
    let Some(server) = start_server() else { return };
    let work = temp_dir("db");
    let db = work.join("orders.db");

    // 1. The worker creates stream and consumer, then dies right after
    //    committing order 3 and before acking it.
    let mut worker = spawn_worker(&server.url, &db, Some(3));
    let client = async_nats::connect(&server.url).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    publish_orders(&js, 1..=5).await;
    let status = worker.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "worker should die by SIGKILL: {status:?}"
    );
    assert_eq!(
        worker.out_lines,
        vec![
            "order 1 (stream seq 1, delivery 1): inserted",
            "order 2 (stream seq 2, delivery 1): inserted",
        ],
        "orders acked before the crash"
    );
    drop(worker);

    // Order 3 is in the table but not acked: ack floor 2, one ack pending.
    let ids: Vec<String> = rows(&db).into_iter().map(|r| r.0).collect();
    assert_eq!(ids, ["1", "2", "3"]);
    let state = consumer_state(&js).await;
    assert_eq!(state["ack_floor"]["stream_seq"], 2, "{state}");
    assert_eq!(state["num_ack_pending"], 1, "{state}");
    assert_eq!(state["num_pending"], 2, "{state}");

    // 2. Restarted, it gets order 3 again (after the 2s ack wait): the upsert
    //    makes that redelivery harmless. Then orders 4 and 5.
    let mut worker = spawn_worker(&server.url, &db, None);
    wait_until_done(&js, 5).await;
    // 3. SIGTERM drains and exits cleanly.
    let status = worker.sigterm();
    assert!(status.success(), "SIGTERM should exit 0: {status:?}");
    worker.wait_stderr("order-worker: stopped cleanly");
    // Orders 4 and 5 usually come first: 3 is redelivered once its ack wait
    // has passed.
    worker.out_lines.sort();
    assert_eq!(
        worker.out_lines,
        vec![
            "order 3 (stream seq 3, delivery 2): redelivery, already applied: no change",
            "order 4 (stream seq 4, delivery 1): inserted",
            "order 5 (stream seq 5, delivery 1): inserted",
        ]
    );
    drop(worker);

    // Every order processed exactly once; order 3 was delivered twice.
    assert_eq!(
        rows(&db),
        vec![
            ("1".to_string(), 1, 1, 1),
            ("2".to_string(), 1, 1, 1),
            ("3".to_string(), 1, 2, 2),
            ("4".to_string(), 1, 1, 1),
            ("5".to_string(), 1, 1, 1),
        ]
    );

    // 4. A restart resumes after the last ack: only the new order arrives.
    let mut worker = spawn_worker(&server.url, &db, None);
    publish_orders(&js, 6..=6).await;
    wait_until_done(&js, 6).await;
    assert!(worker.sigterm().success());
    assert_eq!(
        worker.out_lines,
        vec!["order 6 (stream seq 6, delivery 1): inserted"]
    );
    assert_eq!(rows(&db).len(), 6);
    assert!(rows(&db).iter().all(|r| r.1 == 1), "{:?}", rows(&db));
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn postgres_url_is_refused_with_a_clear_error() {
    let out = Command::new(WORKER)
        .args([
            "--db",
            "postgres://localhost/orders",
            "--server",
            "nats://127.0.0.1:1",
        ])
        .output()
        .expect("run order-worker");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Postgres is not supported"), "{err}");
}
