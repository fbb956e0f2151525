//! The applied marker and `discard_unsynced`, on both stores; and power failures at random
//! points of a workload that sets a new marker before every sync: after each recovery the
//! marker is the one of the last completed sync (or of the sync in progress, when all of
//! its writes reached the disk), and the data is exactly what that sync made durable.

use super::sim::{open, Rng, SimFs};
use crate::*;
use std::collections::BTreeMap;
use std::sync::Arc;

type Msgs = BTreeMap<u64, (Vec<u8>, Vec<u8>)>;

fn small() -> FileStoreConfig {
    FileStoreConfig {
        segment_size: 2048,
        ..Default::default()
    }
}

/// Every message and the last sequence.
fn contents(s: &dyn Store) -> (Msgs, u64) {
    let mut out = BTreeMap::new();
    let mut at = 0;
    while let Ok(m) = s.load_next(at, ">") {
        out.insert(m.seq, (m.subject.to_vec(), m.data.to_vec()));
        at = m.seq + 1;
    }
    (out, s.state().last_seq)
}

fn fill(s: &mut dyn Store, n: usize, tag: u8) {
    for i in 0..n {
        s.store_msg(b"a.b", b"", &[tag; 100][..50 + i % 50], i as i64)
            .unwrap();
    }
}

#[test]
fn marker_survives_reopen_and_old_stores_read_empty() {
    let sim = SimFs::new(1);
    let (mut s, _) = open(&sim, &small());
    assert_eq!(s.applied(), b"");
    fill(&mut s, 10, 1);
    s.sync().unwrap();
    s.close().unwrap();
    drop(s);
    // A store written without markers: empty, and no marker is written for it.
    let (mut s, _) = open(&sim, &small());
    assert_eq!(s.applied(), b"");
    assert!(s.set_applied(&[0; 33]).is_err(), "longer than 32 bytes");
    s.set_applied(b"index 10").unwrap();
    assert_eq!(s.applied(), b"index 10", "the marker last set, in memory");
    fill(&mut s, 30, 2);
    s.sync().unwrap();
    let want = contents(&s);
    s.close().unwrap();
    drop(s);
    let (s, _) = open(&sim, &small());
    assert_eq!(s.applied(), b"index 10");
    assert_eq!(contents(&s), want);
    s.crash();
    sim.crash(0);
    let (s, _) = open(&sim, &small());
    assert_eq!(s.applied(), b"index 10");
    assert_eq!(contents(&s), want);
}

/// The brief's case: marker 1, write, sync; marker 2, write more, power failure before the
/// sync completes: marker 1 and exactly the data of the first sync. A power failure after
/// the fsyncs ran (finish_sync not called yet) may keep marker 2, then with all its data.
#[test]
fn power_failure_before_the_sync_completes_gives_the_previous_marker_and_its_data() {
    let mut saw_old = 0;
    let mut saw_new = 0;
    for seed in 0..300u64 {
        let sim = SimFs::new(seed);
        let (mut s, _) = open(&sim, &small());
        s.set_applied(b"marker1").unwrap();
        fill(&mut s, 20, 1);
        s.remove(3, false).unwrap();
        s.sync().unwrap();
        let one = contents(&s);
        s.set_applied(b"marker2").unwrap();
        fill(&mut s, 10 + seed as usize % 30, 2);
        s.remove(5, false).unwrap();
        s.purge(&Purge {
            seq: Some(2 + seed % 4),
            ..Default::default()
        })
        .unwrap();
        let two = contents(&s);
        // 0: before the sync; 1: its writes made, no fsync; 2: fsyncs done, not recorded.
        let stage = seed % 3;
        if stage > 0 {
            let mut job = s.begin_sync().unwrap().unwrap();
            if stage == 2 {
                job.run();
            }
            drop(job);
        }
        s.crash();
        sim.crash(0);
        let (mut s, rep) = open(&sim, &small());
        assert!(
            rep.lost.is_empty() && rep.damaged.is_empty(),
            "seed {seed}: {rep:?}"
        );
        let got = contents(&s);
        match &s.applied()[..] {
            b"marker1" => {
                assert!(stage < 2, "seed {seed}: a sync on disk was undone");
                assert_eq!(got, one, "seed {seed}: exactly the data of sync 1");
                saw_old += 1;
            }
            b"marker2" => {
                assert!(stage > 0, "seed {seed}: marker 2 was never written");
                assert_eq!(got, two, "seed {seed}: marker 2 comes with all its data");
                saw_new += 1;
            }
            m => panic!("seed {seed}: marker {m:?}"),
        }
        // The store goes on from there; sequences after the marker's sync are reused.
        let next = s.store_msg(b"c", b"", b"x", 0).unwrap();
        assert_eq!(next, got.1 + 1, "seed {seed}");
    }
    assert!(saw_old > 100 && saw_new > 50, "{saw_old} {saw_new}");
}

#[test]
fn discard_unsynced_goes_back_to_the_last_sync() {
    let sim = SimFs::new(2);
    let events = Arc::new(std::sync::Mutex::new(0));
    let (mut s, _) = open(&sim, &small());
    let e = events.clone();
    s.set_observer(Box::new(move |ev| {
        if matches!(ev, StoreEvent::Recovered(_)) {
            *e.lock().unwrap() += 1;
        }
    }));
    s.set_applied(b"m1").unwrap();
    fill(&mut s, 25, 1);
    s.sync().unwrap();
    let one = contents(&s);
    s.set_applied(b"m2").unwrap();
    fill(&mut s, 40, 2);
    assert!(s.remove(2, true).unwrap());
    let at_erase = contents(&s);
    s.remove(7, false).unwrap();
    s.purge(&Purge {
        seq: Some(10),
        ..Default::default()
    })
    .unwrap();
    // The erase synced: that is the last completed sync now, with marker m2.
    let at_erase_sync = s.applied();
    assert_eq!(at_erase_sync, b"m2");
    s.set_applied(b"m3").unwrap();
    fill(&mut s, 5, 3);
    let before_discard = contents(&s);
    s.discard_unsynced().unwrap();
    assert_eq!(s.applied(), b"m2");
    assert_ne!(contents(&s), before_discard);
    assert_eq!(*events.lock().unwrap(), 1, "reported to the observer");
    let after = contents(&s);
    assert_eq!(after, at_erase);
    assert!(!after.0.contains_key(&2) && after.0.contains_key(&7));
    // Nothing unsynced: the same state.
    s.discard_unsynced().unwrap();
    assert_eq!(contents(&s), after);
    // And again from a clean sync with no marker change.
    s.set_applied(b"m4").unwrap();
    s.store_msg(b"z", b"", b"z", 1).unwrap();
    s.sync().unwrap();
    let four = contents(&s);
    s.store_msg(b"z", b"", b"lost", 1).unwrap();
    s.discard_unsynced().unwrap();
    assert_eq!((s.applied(), contents(&s)), (b"m4".to_vec(), four.clone()));
    s.crash();
    sim.crash(0);
    let (s, _) = open(&sim, &small());
    assert_eq!((s.applied(), contents(&s)), (b"m4".to_vec(), four));
    assert_ne!(one, contents(&s));
}

#[test]
fn memory_store_marker() {
    let mut s = MemStore::new(Limits::default());
    assert_eq!(s.applied(), b"");
    s.set_applied(b"abc").unwrap();
    assert_eq!(s.applied(), b"abc");
    assert!(s.set_applied(&[1; 33]).is_err());
    assert_eq!(s.applied(), b"abc");
    // With a marker it rolls back to the last sync (before the first marker: none).
    s.store_msg(b"a", b"", b"1", 1).unwrap();
    s.discard_unsynced().unwrap();
    assert_eq!((s.applied(), s.last_seq()), (b"".to_vec(), 0));
    s.set_applied(b"def").unwrap();
    s.store_msg(b"a", b"", b"1", 1).unwrap();
    s.sync().unwrap();
    s.store_msg(b"a", b"", b"2", 2).unwrap();
    s.set_applied(b"ghi").unwrap();
    s.discard_unsynced().unwrap();
    assert_eq!((s.applied(), s.last_seq()), (b"def".to_vec(), 1));
    let mut plain = MemStore::new(Limits::default());
    assert!(matches!(
        plain.discard_unsynced(),
        Err(StoreError::Unsupported(_))
    ));
}

/// Random writes, removals, purges, syncs (whole or split), compactions and discards with a
/// new marker before every sync, and power failures at random points (bit flips aside).
#[test]
fn marker_and_data_agree_after_power_failures() {
    let seeds = super::sim::seeds(400);
    let cases = seeds.end - seeds.start;
    let mut st = Stats::default();
    for seed in seeds {
        run_case(seed, &mut st);
    }
    eprintln!("{st:?}");
    assert!(st.crashes > cases && (cases < 50 || st.discards > 0));
}

/// Seeds that once failed. 483: a torn erase of a compacted segment's last message (past
/// its entries), whose tombstone a compaction then dropped. 1176: a fresh store's records
/// end before its preallocated space, and the next applied record listed its stretch from
/// there. 9325: a torn erase of a segment's last message put that sequence in the next
/// segment's range, whose compaction then dropped the tombstone as one of its own.
#[test]
fn marker_seeds_that_failed_once() {
    let mut st = Stats::default();
    for seed in [483, 1176, 9325] {
        run_case(seed, &mut st);
    }
}

#[derive(Default, Debug)]
struct Stats {
    crashes: u64,
    newer: u64,
    discards: u64,
}

/// What each marker's sync made durable (the data and the last sequence).
type Durable = BTreeMap<Vec<u8>, (Msgs, u64)>;

/// A seeded case's start: its random source (`salt` per test), a simulated disk, a small
/// store config and the store opened on it with the empty marker set (in use from the
/// start: a store that never had one keeps what reached the disk), as `at` records it.
fn start_case(seed: u64, salt: u64) -> (Rng, SimFs, FileStoreConfig, FileStore, Durable) {
    let mut rng = Rng(seed ^ salt);
    let sim = SimFs::new(seed);
    let cfg = FileStoreConfig {
        segment_size: 1024 + rng.below(3000),
        write_buffer: rng.below(500) as usize,
        ..Default::default()
    };
    let (mut s, _) = open(&sim, &cfg);
    s.set_applied(b"").unwrap();
    let mut at = Durable::new();
    at.insert(Vec::new(), contents(&s));
    (rng, sim, cfg, s, at)
}

fn run_case(seed: u64, st: &mut Stats) {
    let (mut rng, sim, cfg, mut s, mut at) = start_case(seed, 0xA11);
    let mut done = Vec::new();
    let mut k = 0u64;
    for _ in 0..(40 + rng.below(150)) {
        let op = rng.below(20);
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            eprintln!("op {op} k {k} done {:?} state {:?}", num(&done), s.state());
        }
        match op {
            0..=8 => {
                let len = rng.below(300) as usize;
                let subj = [b"a".as_slice(), b"b.c", b"d"][rng.below(3) as usize];
                s.store_msg(subj, b"", &vec![k as u8; len], 0).unwrap();
            }
            9 | 10 => {
                let last = s.state().last_seq;
                let q = 1 + rng.below(last + 1);
                // An erase syncs: a sync with the current marker.
                let erase = rng.chance(4);
                if erase {
                    k += 1;
                    s.set_applied(&k.to_le_bytes()).unwrap();
                }
                let snap_before = contents(&s);
                if std::env::var_os("KEEL_SIM_TRACE").is_some() {
                    eprintln!("remove {q} erase {erase}");
                }
                if s.remove(q, erase).unwrap() && erase {
                    let mut snap = snap_before;
                    snap.0.remove(&q);
                    at.insert(k.to_le_bytes().to_vec(), snap);
                    done = k.to_le_bytes().to_vec();
                }
            }
            11 => {
                let st = s.state();
                let seq = st.first_seq + rng.below(st.msgs + 2);
                s.purge(&Purge {
                    seq: Some(seq),
                    ..Default::default()
                })
                .unwrap();
            }
            12..=15 => {
                k += 1;
                let m = k.to_le_bytes().to_vec();
                s.set_applied(&m).unwrap();
                let snap = contents(&s);
                if rng.chance(2) {
                    s.sync().unwrap();
                    at.insert(m.clone(), snap);
                    done = m;
                } else if let Some(mut job) = s.begin_sync().unwrap() {
                    at.insert(m.clone(), snap);
                    if rng.chance(6) {
                        // Power fails during this sync.
                        if rng.chance(2) {
                            job.run();
                        }
                        drop(job);
                        s = crash(s, &sim, &cfg, &at, &mut done, seed, &mut st.newer);
                        st.crashes += 1;
                        continue;
                    }
                    job.run();
                    s.finish_sync(job).unwrap();
                    done = m;
                }
            }
            16 => {
                // compact_begin syncs first: a sync with the current marker.
                k += 1;
                let m = k.to_le_bytes().to_vec();
                s.set_applied(&m).unwrap();
                let snap = contents(&s);
                if let Some(job) = s.compact_begin() {
                    if std::env::var_os("KEEL_SIM_TRACE").is_some() {
                        eprintln!("compact {}", job.segment());
                    }
                    let d = job.run();
                    s.compact_end(d).unwrap();
                }
                at.insert(m.clone(), snap);
                done = m;
            }
            17 => {
                if std::env::var_os("KEEL_SIM_TRACE").is_some() {
                    eprintln!("discard");
                }
                s.discard_unsynced().unwrap();
                st.discards += 1;
                assert_eq!(s.applied(), done, "seed {seed}: discard");
                assert_eq!(&contents(&s), &at[&done], "seed {seed}: discard");
            }
            _ => {
                s = crash(s, &sim, &cfg, &at, &mut done, seed, &mut st.newer);
                st.crashes += 1;
            }
        }
    }
    crash(s, &sim, &cfg, &at, &mut done, seed, &mut st.newer);
}

fn num(m: &[u8]) -> u64 {
    m.try_into().map_or(0, u64::from_le_bytes)
}

/// Power failure, reopen, check; the store reopened.
fn crash(
    s: FileStore,
    sim: &SimFs,
    cfg: &FileStoreConfig,
    at: &Durable,
    done: &mut Vec<u8>,
    seed: u64,
    newer: &mut u64,
) -> FileStore {
    s.crash();
    sim.crash(0);
    if std::env::var_os("KEEL_SIM_TRACE").is_some() {
        dump(sim);
    }
    let (s, rep) = open(sim, cfg);
    assert!(
        rep.lost.is_empty() && rep.damaged.is_empty(),
        "seed {seed}: {rep:?}"
    );
    let m = s.applied();
    let want = at
        .get(&m)
        .unwrap_or_else(|| panic!("seed {seed}: marker {m:?} never written"));
    assert!(
        num(&m) >= num(done),
        "seed {seed}: marker {m:?} older than the last completed sync's {done:?}"
    );
    let got = contents(&s);
    let keys = |c: &(Msgs, u64)| (c.0.keys().copied().collect::<Vec<_>>(), c.1);
    assert_eq!(keys(&got), keys(want), "seed {seed}: data of marker {m:?}");
    assert!(&got == want, "seed {seed}: content with marker {m:?}");
    if m != *done {
        *newer += 1;
    }
    *done = m;
    s
}

fn dump(sim: &SimFs) {
    for (name, data) in sim.dump() {
        if !name.to_string_lossy().ends_with(".seg") {
            eprintln!("   {} {} bytes", name.display(), data.len());
            continue;
        }
        let mut o = 0;
        let mut recs = Vec::new();
        while o < data.len() {
            match crate::record::parse(&data[o..]) {
                crate::record::Parse::Ok(r) => {
                    let extra = match r.kind {
                        crate::record::Kind::Ledger => {
                            format!("{:?}", crate::record::decode_ledger(r.data))
                        }
                        crate::record::Kind::Marker => format!("{:?}", r.data),
                        _ => String::new(),
                    };
                    recs.push(format!("{:?}{}@{o}{extra}", r.kind, r.seq));
                    o += r.len;
                }
                crate::record::Parse::Bad => {
                    recs.push(format!("BAD@{o}..{}", data.len()));
                    match crate::record::resync(&data, o + 1) {
                        Some(n) => o = n,
                        None => break,
                    }
                }
            }
        }
        eprintln!("   {}: {}", name.display(), recs.join(" "));
    }
}

/// Allocation ahead writes zeros where a sync waits for a small write (the buffer a sync
/// flushes), and uses fallocate where a full write buffer goes out in a stream of writes
/// (copying zeros there cost more than the metadata they save).
#[test]
fn allocation_writes_zeros_only_for_what_a_sync_flushes() {
    let sim = SimFs::new(4);
    let cfg = FileStoreConfig {
        segment_size: 8 << 20,
        write_buffer: 16 << 10,
        ..Default::default()
    };
    let (mut s, _) = open(&sim, &cfg);
    let base = sim.allocations();
    // Small messages past the new segment's first 4 KiB, then their sync: the buffer the
    // sync flushes.
    for i in 0..60 {
        s.store_msg(b"a.b", b"", &[1; 100][..], i).unwrap();
    }
    s.sync().unwrap();
    let after_sync = sim.allocations();
    assert!(after_sync.0 > base.0, "{base:?} -> {after_sync:?}");
    assert_eq!(after_sync.1, base.1, "{base:?} -> {after_sync:?}");
    // A stream of 1 MiB with no sync: full buffers flushed, far past what was allocated.
    for i in 0..256 {
        s.store_msg(b"a.b", b"", &[2; 4096][..], 60 + i).unwrap();
    }
    let streamed = sim.allocations();
    assert!(streamed.1 > after_sync.1, "{after_sync:?} -> {streamed:?}");
    assert_eq!(streamed.0, after_sync.0, "{after_sync:?} -> {streamed:?}");
}

/// A replica's store on a disk that fills and gets room back: writes, syncs and closes
/// fail at random points, a failed close is followed by opening the directory again (no
/// power loss). After every sync that works and every reopen, the data and the last
/// sequence are exactly those of the marker the store reports: a replicated stream applies
/// its log again from that marker, and skips a message at or below the store's last
/// sequence, so a last sequence kept past the marker's would leave a hole in the stream.
#[test]
fn marker_and_data_agree_after_failed_writes_and_closes() {
    let seeds = super::sim::seeds(400);
    let cases = seeds.end - seeds.start;
    let mut failed = 0;
    for seed in seeds {
        failed += full_disk_case(seed);
    }
    assert!(
        failed > cases,
        "{failed} failed operations in {cases} cases"
    );
}

fn full_disk_case(seed: u64) -> u64 {
    let trace = std::env::var_os("KEEL_SIM_TRACE").is_some();
    let (mut rng, sim, cfg, mut s, mut at) = start_case(seed, 0xD15C);
    let mut k = 0u64;
    let mut failures = 0;
    let check = |s: &FileStore, at: &Durable, what: &str| {
        let m = s.applied();
        let want = at
            .get(&m)
            .unwrap_or_else(|| panic!("seed {seed}: {what}: marker {m:?} never written"));
        assert_eq!(
            &contents(s),
            want,
            "seed {seed}: {what}: data and last sequence of marker {:?}",
            num(&m)
        );
    };
    for _ in 0..(40 + rng.below(150)) {
        let op = rng.below(20);
        if trace {
            eprintln!("op {op} k {k} state {:?}", s.state());
        }
        match op {
            0..=9 => {
                let len = rng.below(300) as usize;
                let next = s.state().last_seq + 1;
                let r = s.store_at(next, b"a", b"", &vec![k as u8; len], 0);
                failures += r.is_err() as u64;
            }
            10..=13 => {
                k += 1;
                let m = k.to_le_bytes().to_vec();
                // (A sync that fails may still have made all of this durable.)
                let set = s.set_applied(&m);
                at.insert(m, contents(&s));
                if set.is_err() {
                    failures += 1;
                    continue;
                }
                // Half the time split, as a group's syncer runs it (the fsyncs unlocked).
                let r = if rng.chance(2) {
                    s.sync()
                } else {
                    match s.begin_sync() {
                        Ok(Some(mut job)) => {
                            job.run();
                            s.finish_sync(job)
                        }
                        Ok(None) => Ok(()),
                        Err(e) => Err(e),
                    }
                };
                match r {
                    Ok(()) => check(&s, &at, "sync"),
                    Err(_) => failures += 1,
                }
            }
            14 | 15 => {
                let n = rng.below(25);
                if trace {
                    eprintln!("fail after {n}");
                }
                sim.fail_after(n);
            }
            16 => sim.heal(),
            17 => {
                // A leader's failed commit: back to the last sync.
                match s.discard_unsynced() {
                    Ok(()) => check(&s, &at, "discard"),
                    Err(_) => failures += 1,
                }
            }
            _ => {
                // A close that fails (a full disk) is followed by opening the directory
                // again once there is room, as a replica loaded again from its files is.
                // (A close syncs with the marker it has: a replica sets one per batch.)
                k += 1;
                let m = k.to_le_bytes().to_vec();
                let _ = s.set_applied(&m);
                at.insert(m, contents(&s));
                let r = s.close();
                if trace {
                    eprintln!("close => {r:?}");
                }
                failures += r.is_err() as u64;
                drop(s);
                sim.heal();
                s = open(&sim, &cfg).0;
                check(&s, &at, "reopen");
            }
        }
    }
    failures
}
