//! Measures the file store: append throughput with group commit (batches with one sync)
//! and with a sync per message, and restart time with and without the saved index.
//!
//! `cargo run --release -p keel-store --example store_bench -- [dir] [messages]`

use keel_store::{FileStore, Limits, Store};
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let base = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "/tmp/keel-store-bench".into()),
    );
    let n: u64 = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let _ = std::fs::remove_dir_all(&base);
    let payload = vec![b'x'; 128];
    let subjects: Vec<String> = (0..100).map(|i| format!("orders.region{i}")).collect();

    // Group commit: batches of 100, one sync each.
    let dir = base.join("batch");
    let (mut s, _) = FileStore::open(&dir, Limits::default()).unwrap();
    let t = Instant::now();
    for i in 0..n {
        s.store_msg(
            subjects[(i % 100) as usize].as_bytes(),
            b"",
            &payload,
            i as i64,
        )
        .unwrap();
        if i % 100 == 99 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
    let el = t.elapsed();
    println!(
        "store_msg x{n} (128 B), sync every 100: {:.2?}  = {:.0} msgs/s, {:.1} MB/s payload",
        el,
        n as f64 / el.as_secs_f64(),
        (n * 128) as f64 / el.as_secs_f64() / 1e6
    );

    // Without any sync (pure append cost).
    let dir2 = base.join("nosync");
    let (mut s2, _) = FileStore::open(&dir2, Limits::default()).unwrap();
    let t = Instant::now();
    for i in 0..n {
        s2.store_msg(
            subjects[(i % 100) as usize].as_bytes(),
            b"",
            &payload,
            i as i64,
        )
        .unwrap();
    }
    let el = t.elapsed();
    println!(
        "store_msg x{n} (128 B), no sync: {:.2?}  = {:.0} msgs/s",
        el,
        n as f64 / el.as_secs_f64()
    );
    drop(s2);
    let _ = std::fs::remove_dir_all(&dir2);

    // A sync per message.
    let dir3 = base.join("each");
    let (mut s3, _) = FileStore::open(&dir3, Limits::default()).unwrap();
    let m = 2000;
    let t = Instant::now();
    for i in 0..m {
        s3.store_msg(b"orders.one", b"", &payload, i).unwrap();
        s3.sync().unwrap();
    }
    let el = t.elapsed();
    println!(
        "store_msg+sync x{m}: {:.2?}  = {:.0} msgs/s ({:.0} us per sync)",
        el,
        m as f64 / el.as_secs_f64(),
        el.as_secs_f64() * 1e6 / m as f64
    );
    drop(s3);
    let _ = std::fs::remove_dir_all(&dir3);

    // Restarts.
    let t = Instant::now();
    s.close().unwrap();
    println!("close (sync + write index): {:.2?}", t.elapsed());
    drop(s);
    let disk: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    println!("on disk: {:.1} MB", disk as f64 / 1e6);

    for round in 0..2 {
        let t = Instant::now();
        let (mut s, rep) = FileStore::open(&dir, Limits::default()).unwrap();
        let el = t.elapsed();
        assert!(rep.used_index);
        assert_eq!(s.state().msgs, n);
        println!(
            "restart with saved index (round {round}): {:.2?}  {} segments",
            el, rep.segments
        );
        s.close().unwrap();
    }
    for round in 0..2 {
        std::fs::remove_file(dir.join("index.bin")).unwrap();
        let t = Instant::now();
        let (mut s, rep) = FileStore::open(&dir, Limits::default()).unwrap();
        let el = t.elapsed();
        assert!(!rep.used_index);
        assert_eq!(s.state().msgs, n);
        println!(
            "restart with full scan (round {round}): {:.2?}  {} records in {} segments",
            el, rep.records_scanned, rep.segments
        );
        s.close().unwrap();
    }
    let _ = std::fs::remove_dir_all(&base);
}
