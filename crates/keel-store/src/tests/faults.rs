//! Storage faults a deployment meets: synced data that a disk or a restore lost, damage in
//! sealed segments, a full disk, many segments, a second process on the same directory,
//! and damaged metadata files. Each test here failed on the store before these were
//! handled.

use super::file_tests::{small, TempDir};
use super::model::payload;
use super::sim::{Rng, SimFs};
use crate::meta::{MetaFiles, MetaRead};
use crate::record::HEADS_LEN;
use crate::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

fn open(dir: &Path) -> (FileStore, RecoveryReport) {
    FileStore::open_with(dir, Limits::default(), small()).unwrap()
}

fn fill(s: &mut FileStore, n: u64) {
    for i in 0..n {
        s.store_msg(b"a", b"", &payload(1, 60, i), 1).unwrap();
        if i % 50 == 49 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    v.sort();
    v
}

fn seqs(ranges: &[(u64, u64)]) -> Vec<u64> {
    ranges.iter().flat_map(|&(a, b)| a..=b).collect()
}

/// Issue 9 item 2: after a clean stop the last segment loses half its (synced) bytes.
/// last_seq must not fall back, the missing messages are reported lost, and new messages
/// continue after the highest sequence ever handed out.
#[test]
fn cut_tail_after_clean_stop_never_reuses_sequences() {
    let d = TempDir::new();
    let (mut s, _) = open(&d.0);
    fill(&mut s, 500);
    s.close().unwrap();
    drop(s);
    let last = segments(&d.0).pop().unwrap();
    let len = std::fs::metadata(&last).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&last).unwrap();
    f.set_len(HEADS_LEN as u64 + (len - HEADS_LEN as u64) / 2)
        .unwrap();
    drop(f);

    let (mut s, rep) = open(&d.0);
    let st = s.state();
    assert_eq!(st.last_seq, 500, "{rep:?}");
    let lost = st.lost.clone().expect("the cut messages are reported lost");
    assert!(
        !lost.msgs.is_empty() && *lost.msgs.last().unwrap() == 500,
        "{lost:?}"
    );
    assert_eq!(seqs(&rep.lost), lost.msgs);
    assert_eq!(st.msgs + lost.msgs.len() as u64, 500);
    assert_eq!(rep.records_last_seq, Some(500 - lost.msgs.len() as u64));
    assert!(lost.msgs.iter().all(|&q| s.load(q).is_err()));
    // num_pending for a consumer that had seen everything counts only new messages.
    assert_eq!(s.num_pending(501, ">", false), 0);
    let seq = s.store_msg(b"a", b"", b"new", 2).unwrap();
    assert_eq!(seq, 501);
    assert_eq!(s.num_pending(501, ">", false), 1);
    s.close().unwrap();
    drop(s);
    // The report survives restarts, with and without the index.
    let (s, rep) = open(&d.0);
    assert!(rep.used_index && rep.lost.is_empty());
    assert_eq!(s.state().lost.unwrap().msgs, lost.msgs);
    s.crash();
    super::file_tests::remove_indexes(&d.0);
    let (s, rep) = open(&d.0);
    assert!(rep.lost.is_empty(), "{rep:?}");
    let st = s.state();
    assert_eq!((st.last_seq, st.lost.unwrap().msgs), (501, lost.msgs));
}

/// The same after a crash (no index): the segment heads carry the highest sequence.
#[test]
fn cut_tail_after_crash_never_reuses_sequences() {
    let d = TempDir::new();
    let (mut s, _) = open(&d.0);
    fill(&mut s, 500);
    // One more sync so the heads prove the last batch was durable too.
    s.store_msg(b"b", b"", b"x", 1).unwrap();
    s.sync().unwrap();
    s.crash();
    let last = segments(&d.0).pop().unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&last).unwrap();
    f.set_len(HEADS_LEN as u64).unwrap();
    drop(f);
    let (mut s, rep) = open(&d.0);
    let st = s.state();
    assert_eq!(st.last_seq, 501, "{rep:?}");
    let lost = st.lost.unwrap().msgs;
    assert!(!lost.is_empty());
    // Everything up to the last sync known complete is lost; the very last sync's
    // messages may have been cut by the crash itself (unacknowledged): either way they
    // are missing, reported, and their sequences are not handed out again.
    let missing: Vec<u64> = lost.iter().copied().chain(seqs(&rep.unacked)).collect();
    assert_eq!(*missing.iter().max().unwrap(), 501);
    assert_eq!(st.msgs + missing.len() as u64, 501);
    assert_eq!(s.store_msg(b"a", b"", b"new", 2).unwrap(), 502);
}

/// Issue 9 item 3: a segment in the middle goes missing (clean stop or crash).
#[test]
fn missing_middle_segment_is_reported() {
    for clean in [true, false] {
        let d = TempDir::new();
        let (mut s, _) = open(&d.0);
        fill(&mut s, 500);
        let before = s.state();
        if clean {
            s.close().unwrap();
            drop(s);
        } else {
            s.store_msg(b"b", b"", b"x", 1).unwrap();
            s.sync().unwrap();
            s.crash();
        }
        let segs = segments(&d.0);
        assert!(segs.len() > 5);
        let victim = &segs[segs.len() / 2];
        let mut held = Vec::new();
        {
            let (s, _) = open(&d.0);
            // Which sequences the victim holds, read through the store itself.
            for q in 1..=before.last_seq {
                let id = s.segment_of(q).unwrap();
                if d.0.join(format!("{id:010}.seg")) == *victim {
                    held.push(q);
                }
            }
            s.crash();
        }
        std::fs::remove_file(victim).unwrap();
        let (s, rep) = open(&d.0);
        assert_eq!(seqs(&rep.lost), held, "clean {clean}: {rep:?}");
        let st = s.state();
        assert_eq!(st.lost.unwrap().msgs, held);
        assert!(st.last_seq >= before.last_seq);
        assert_eq!(st.msgs, st.last_seq - held.len() as u64);
        assert_eq!(
            s.num_pending(1, ">", false),
            st.last_seq - held.len() as u64
        );
    }
}

/// Issue 9 item 3: damage at the end of a sealed segment (synced, not the newest) is not a
/// torn write: the bytes are copied aside, the segment is not cut, the loss is reported.
#[test]
fn damage_at_the_end_of_a_sealed_segment_is_kept_and_reported() {
    let d = TempDir::new();
    let (mut s, _) = open(&d.0);
    fill(&mut s, 300);
    s.crash();
    let segs = segments(&d.0);
    let sealed = &segs[1];
    let mut b = std::fs::read(sealed).unwrap();
    let n = b.len();
    for x in &mut b[n - 30..] {
        *x = 0;
    }
    std::fs::write(sealed, &b).unwrap();
    let (s, rep) = open(&d.0);
    assert_eq!(std::fs::metadata(sealed).unwrap().len() as usize, n);
    assert_eq!(rep.damaged.len(), 1, "{rep:?}");
    assert!(rep.torn.is_empty(), "{rep:?}");
    let q = rep.damaged[0].quarantine.clone().unwrap();
    let copy = std::fs::read(d.0.join(&q)).unwrap();
    assert_eq!(&copy[copy.len() - 30..], &[0u8; 30][..]);
    assert_eq!(rep.lost.len(), 1);
    let (a, b) = rep.lost[0];
    assert_eq!(a, b);
    assert!(s.load(a).is_err());
    assert_eq!(s.state().lost.unwrap().msgs, vec![a]);
}

/// Issue 9 item 3: with the index (clean restart), a zeroed 4 KB stretch is found when
/// read, leaves the counts, is copied aside and reported; the rest is served.
#[test]
fn zeroed_range_under_the_index_is_reported_when_read() {
    let d = TempDir::new();
    let cfg = FileStoreConfig {
        segment_size: 64 << 10,
        ..small()
    };
    let (mut s, _) = FileStore::open_with(&d.0, Limits::default(), cfg.clone()).unwrap();
    for i in 0..400 {
        s.store_msg(b"a", b"", &payload(1, 100, i), 1).unwrap();
    }
    s.close().unwrap();
    drop(s);
    let seg = segments(&d.0)[0].clone();
    let mut b = std::fs::read(&seg).unwrap();
    for x in &mut b[8192..12288] {
        *x = 0;
    }
    std::fs::write(&seg, &b).unwrap();
    let (s, rep) = FileStore::open_with(&d.0, Limits::default(), cfg).unwrap();
    assert!(rep.used_index);
    let mut served = 0;
    let mut at = 1;
    while let Ok(m) = s.load_next(at, ">") {
        assert_eq!(m.data, payload(1, 100, m.seq - 1));
        served += 1;
        at = m.seq + 1;
    }
    let st = s.state();
    let lost = st.lost.unwrap().msgs;
    // Records of 141 bytes: 4 KB touches 29 or 30 of them.
    assert!((29..=31).contains(&lost.len()), "{lost:?}");
    assert_eq!(served + lost.len() as u64, 400);
    assert_eq!(st.msgs, served);
    assert_eq!(s.num_pending(1, ">", false), served);
    let copies = std::fs::read_dir(&d.0)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("damaged-")
        })
        .count();
    assert_eq!(copies, lost.len());
}

/// Also: a stream of many segments keeps a bounded number of them open.
#[test]
fn open_segment_files_are_bounded() {
    let sim = SimFs::new(3);
    let cfg = FileStoreConfig {
        segment_size: 512,
        write_buffer: 0,
        max_open_files: 16,
        ..Default::default()
    };
    let (mut s, _) = FileStore::open_fs(
        Arc::new(sim.clone()),
        Path::new("/s"),
        Limits::default(),
        cfg.clone(),
    )
    .unwrap();
    for i in 0..2000 {
        s.store_msg(b"a", b"", &payload(1, 100, i), 1).unwrap();
        if i % 10 == 0 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
    assert!(s.segment_count() > 300);
    // Reads all over the stream.
    let mut rng = Rng(5);
    for _ in 0..3000 {
        let q = 1 + rng.below(2000);
        assert_eq!(s.load(q).unwrap().data, payload(1, 100, q - 1));
    }
    assert!(s.open_files() <= 16, "{}", s.open_files());
    let (now, max) = sim.handles();
    assert!(max <= 20, "{max} files open at once");
    s.close().unwrap();
    drop(s);
    assert_eq!(sim.handles().0, 0);
    // Recovery (with and without the index) stays within the bound too.
    let (s, _) = FileStore::open_fs(
        Arc::new(sim.clone()),
        Path::new("/s"),
        Limits::default(),
        cfg.clone(),
    )
    .unwrap();
    assert!(s.open_files() <= 16);
    s.crash();
    let _ = now;
    for p in sim.names() {
        if p.extension().is_some_and(|e| e == "idx") {
            sim.lose(&p);
        }
    }
    let before = sim.handles().1;
    let (s, _) = FileStore::open_fs(
        Arc::new(sim.clone()),
        Path::new("/s"),
        Limits::default(),
        cfg,
    )
    .unwrap();
    assert_eq!(s.state().msgs, 2000);
    assert!(sim.handles().1 <= before.max(20));
    // The default bound is sensible, and holds too.
    assert_eq!(FileStoreConfig::default().max_open_files, 256);
    let sim = SimFs::new(4);
    let cfg = FileStoreConfig {
        segment_size: 512,
        write_buffer: 0,
        ..Default::default()
    };
    let (mut s, _) = FileStore::open_fs(
        Arc::new(sim.clone()),
        Path::new("/t"),
        Limits::default(),
        cfg,
    )
    .unwrap();
    for i in 0..2000 {
        s.store_msg(b"a", b"", &payload(1, 100, i), 1).unwrap();
        if i % 10 == 0 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
    assert!(s.segment_count() > 300);
    assert!(
        sim.handles().1 <= 256 + 4,
        "{} files open at once",
        sim.handles().1
    );
}

/// Issue 9 item 5: a write or sync fails (a full disk). The batch since the last sync is
/// rolled back (not in the store, before or after a restart), and once the fault is gone
/// the store takes writes again without being reopened.
#[test]
fn failed_sync_rolls_back_and_the_store_recovers() {
    for fail_at in 0..40 {
        let sim = SimFs::new(fail_at);
        let (mut s, _) = FileStore::open_fs(
            Arc::new(sim.clone()),
            Path::new("/s"),
            Limits::default(),
            small(),
        )
        .unwrap();
        let mut acked = BTreeMap::new();
        for i in 0..200u64 {
            let seq = s.store_msg(b"a", b"", &payload(2, 80, i), 1).unwrap();
            acked.insert(seq, i);
        }
        s.sync().unwrap();
        sim.fail_after(fail_at);
        let mut errored = false;
        for i in 200..260u64 {
            if s.store_msg(b"a", b"", &payload(2, 80, i), 1).is_err() {
                errored = true;
                break;
            }
        }
        let r = s.sync();
        if !errored && r.is_ok() {
            // The fault came too late to hit this batch.
            continue;
        }
        assert!(r.is_err(), "fail_at {fail_at}");
        // Still failing: refused, nothing changes.
        assert!(s.store_msg(b"a", b"", b"x", 1).is_err());
        assert!(s.sync().is_err());
        // Space is back: the next sync rolls back for good and writes work again.
        sim.heal();
        let _ = s.sync();
        let st = s.state();
        assert_eq!((st.msgs, st.last_seq), (200, 200), "fail_at {fail_at}");
        let seq = s.store_msg(b"a", b"", &payload(2, 80, 999), 1).unwrap();
        assert_eq!(seq, 201);
        s.sync().unwrap();
        acked.insert(seq, 999);
        s.crash();
        sim.crash(0);
        let (s, rep) = FileStore::open_fs(
            Arc::new(sim.clone()),
            Path::new("/s"),
            Limits::default(),
            small(),
        )
        .unwrap();
        assert!(rep.lost.is_empty() && rep.damaged.is_empty(), "{rep:?}");
        let st = s.state();
        assert_eq!(st.msgs, acked.len() as u64);
        for (&seq, &i) in &acked {
            assert_eq!(s.load(seq).unwrap().data, payload(2, 80, i));
        }
    }
}

/// Issue 9 item 6: one process per store directory.
#[test]
fn store_directory_lock_is_exclusive() {
    let d = TempDir::new();
    let held = lock_dir(&d.0).unwrap();
    let err = lock_dir(&d.0).unwrap_err();
    assert!(err.contains(&d.0.display().to_string()), "{err}");
    assert!(
        err.contains(&format!("pid {}", std::process::id())),
        "{err}"
    );
    drop(held);
    let again = lock_dir(&d.0).unwrap();
    drop(again);
}

// ---- metadata files ---------------------------------------------------------------------

fn version(b: &[u8]) -> u64 {
    std::str::from_utf8(b)
        .unwrap()
        .strip_prefix("{\"v\":")
        .and_then(|r| r.strip_suffix('}'))
        .unwrap()
        .parse()
        .unwrap()
}

/// Issue 9 item 4, consumer state files under power failures (the simulator also loses
/// directory entries, tears writes, fails operations and flips bits): every version read
/// back was written; one whose durable write returned (what a confirmed AckSync waits for)
/// or a newer one survives; a damaged current copy falls back to an older good one (so
/// the consumer redelivers, never skips), never to garbage. `make_durable_under` (what a
/// replicated stream runs before its store's marker is synced) makes the last version
/// written without fsync count as durable too.
#[test]
fn confirmed_ack_sync_state_survives_power_failures() {
    let cases = super::sim::cases(2000);
    let path = Path::new("/c/state.json");
    let mut fallbacks = 0;
    let mut durable_checked = 0;
    let mut made_durable = 0;
    for seed in 0..cases {
        let sim = SimFs::new(seed);
        let mut m = MetaFiles::with_fs(Arc::new(sim.clone()));
        let mut rng = Rng(seed);
        let mut written = 0u64;
        let mut durable = 0u64;
        // The last version this process wrote successfully (unknown after a crash).
        let mut last_ok: Option<u64> = None;
        // Once bytes were scribbled on, reads may find every copy damaged.
        let mut scribbled = false;
        for _ in 0..(5 + rng.below(40)) {
            match rng.below(10) {
                0..=6 => {
                    written += 1;
                    let body = format!("{{\"v\":{written}}}");
                    let sync = rng.chance(3);
                    if rng.chance(12) {
                        sim.fail_after(rng.below(6));
                    }
                    // In place or by rename, mixed (a file once written in place stays so).
                    let in_place = rng.chance(2);
                    let r = if in_place {
                        m.overwrite(path, body.as_bytes(), sync)
                    } else {
                        m.write(path, body.as_bytes(), sync)
                    };
                    if std::env::var_os("KEEL_SIM_TRACE").is_some() {
                        eprintln!(
                            "write {written} sync {sync} in place {in_place} => {r:?} names {:?}",
                            sim.names()
                        );
                    }
                    if r.is_ok() {
                        last_ok = Some(written);
                    }
                    if r.is_ok() && sync {
                        durable = written;
                    }
                }
                8 if rng.chance(2) => {
                    if rng.chance(12) {
                        sim.fail_after(rng.below(3));
                    }
                    let r = m.make_durable_under(Path::new("/c"));
                    if let (Ok(n), Some(v)) = (r, last_ok) {
                        if n > 0 {
                            made_durable += 1;
                            durable = durable.max(v);
                        }
                    }
                }
                7 => {
                    let flips = rng.chance(4) as usize;
                    sim.crash(flips);
                    last_ok = None;
                    // Flipped bits stay: later reads may still find every copy damaged.
                    scribbled |= flips > 0;
                    // A new process.
                    m = MetaFiles::with_fs(Arc::new(sim.clone()));
                    let got = m.read(path);
                    if std::env::var_os("KEEL_SIM_TRACE").is_some() {
                        eprintln!("crash flips {flips} read {got:?} names {:?}", sim.names());
                    }
                    let v = match &got {
                        MetaRead::Current(b) => Some(version(b)),
                        MetaRead::Older { body, .. } => {
                            fallbacks += 1;
                            Some(version(body))
                        }
                        MetaRead::Missing => None,
                        MetaRead::Damaged(_) => {
                            // Only damage, or writes none of which was durable.
                            assert!(
                                flips > 0 || scribbled || durable == 0,
                                "seed {seed}: {got:?}"
                            );
                            None
                        }
                        // Damage that turned the header into something else entirely.
                        MetaRead::Unchecked(_) if flips > 0 || scribbled => None,
                        MetaRead::Unchecked(_) => panic!("seed {seed}: {got:?}"),
                    };
                    if let Some(v) = v {
                        assert!(v <= written, "seed {seed}: {v} never written");
                    }
                    if flips == 0 && !scribbled {
                        durable_checked += 1;
                        assert!(
                            v.unwrap_or(0) >= durable,
                            "seed {seed}: durable version {durable} lost, got {got:?}"
                        );
                    }
                    // Damage can take the confirmed version with it; what the fallback
                    // returned is then the baseline.
                    if flips > 0 || scribbled {
                        durable = durable.min(v.unwrap_or(0));
                    }
                }
                _ => {
                    // A bit flip in whatever is there: the read never returns it.
                    scribbled = true;
                    for (p, data) in sim.dump() {
                        if !data.is_empty() && rng.chance(2) {
                            let at = rng.below(data.len() as u64) as usize;
                            sim.scribble(&p, at, &[data[at] ^ 0x04]);
                        }
                    }
                    match m.read(path) {
                        MetaRead::Current(b) | MetaRead::Older { body: b, .. } => {
                            assert!(version(&b) <= written)
                        }
                        MetaRead::Missing | MetaRead::Damaged(_) | MetaRead::Unchecked(_) => {}
                    }
                }
            }
        }
    }
    assert!(fallbacks > 0 && durable_checked > 0 && made_durable > 0);
}

/// Issue 9 item 4: a one-bit flip that keeps the JSON valid (delivered 5000 -> 7000) is
/// caught, and the previous good copy is used.
#[test]
fn damaged_state_file_falls_back_to_the_previous_copy() {
    let d = TempDir::new();
    let m = MetaFiles::new();
    let p = d.0.join("state.json");
    let alt = d.0.join("state.json.alt");
    m.overwrite(&p, br#"{"delivered":4000}"#, true).unwrap();
    m.overwrite(&p, br#"{"delivered":5000}"#, true).unwrap();
    // The two copies are the two slots.
    let holding = |text: &[u8]| {
        [&p, &alt]
            .into_iter()
            .find(|f| {
                let b = std::fs::read(f).unwrap_or_default();
                b.windows(text.len()).any(|w| w == text)
            })
            .unwrap()
            .clone()
    };
    let newest = holding(b"5000");
    let mut b = std::fs::read(&newest).unwrap();
    let at = b.windows(4).position(|w| w == b"5000").unwrap();
    b[at] = b'7';
    std::fs::write(&newest, &b).unwrap();
    match m.read(&p) {
        MetaRead::Older { body, damage } => {
            assert_eq!(body, br#"{"delivered":4000}"#);
            assert!(damage.contains("checksum"), "{damage}");
        }
        other => panic!("{other:?}"),
    }
    // A durable write goes to the other slot than the newest durable copy; the damaged
    // one is still reported until it is written again.
    m.overwrite(&p, br#"{"delivered":6000}"#, true).unwrap();
    assert!(matches!(m.read(&p), MetaRead::Older { body, .. } if body == br#"{"delivered":6000}"#));
    m.overwrite(&p, br#"{"delivered":7000}"#, false).unwrap();
    assert_eq!(
        m.read(&p),
        MetaRead::Current(br#"{"delivered":7000}"#.to_vec())
    );
    // A shorter copy over a longer one: the stale tail is not part of it. (It goes over
    // the copy written without fsync, not the durable one.)
    m.overwrite(&p, br#"{"d":1}"#, true).unwrap();
    assert_eq!(m.read(&p), MetaRead::Current(br#"{"d":1}"#.to_vec()));
    std::fs::write(holding(br#"{"d":1}"#), b"garbage").unwrap();
    match m.read(&p) {
        MetaRead::Older { body, .. } => assert_eq!(body, br#"{"delivered":6000}"#),
        other => panic!("{other:?}"),
    }
    std::fs::write(holding(b"6000"), b"junk").unwrap();
    assert!(matches!(m.read(&p), MetaRead::Damaged(_)));
    assert_eq!(m.read(&d.0.join("nothing.json")), MetaRead::Missing);
}

/// A first write cut short (a full disk, a crash before its rename) leaves a `.tmp` that
/// does not verify and no slot: nothing was ever written whole, so the file reads as
/// missing, not damaged (a full disk is not damage). With a damaged slot it is damage.
#[test]
fn an_interrupted_first_write_reads_as_missing() {
    let d = TempDir::new();
    std::fs::create_dir_all(&d.0).unwrap();
    let p = d.0.join("state");
    std::fs::write(d.0.join("state.tmp"), b"").unwrap();
    let m = MetaFiles::new();
    assert_eq!(m.read(&p), MetaRead::Missing);
    std::fs::write(d.0.join("state.alt.tmp"), b"KEELMETA2 12 00").unwrap();
    assert_eq!(m.read(&p), MetaRead::Missing);
    std::fs::write(&p, b"junk").unwrap();
    assert!(matches!(m.read(&p), MetaRead::Damaged(_)));
    // Written whole afterwards, it reads.
    std::fs::remove_file(&p).unwrap();
    let m = MetaFiles::new();
    m.write(&p, b"{\"v\":1}", true).unwrap();
    assert_eq!(m.read(&p), MetaRead::Current(b"{\"v\":1}".to_vec()));
}

/// A file written by an older Keel (renamed over, `KEELMETA1`, a `.prev` fallback) reads,
/// and the first write after it keeps it until a newer copy is durable.
#[test]
fn files_of_the_rename_format_still_read() {
    let d = TempDir::new();
    let p = d.0.join("state.json");
    let v1 = |body: &[u8]| {
        let mut b =
            format!("KEELMETA1 {} {:08x}\n", body.len(), crc32fast::hash(body)).into_bytes();
        b.extend_from_slice(body);
        b
    };
    std::fs::create_dir_all(&d.0).unwrap();
    std::fs::write(&p, v1(b"{\"v\":2}")).unwrap();
    std::fs::write(d.0.join("state.json.prev"), v1(b"{\"v\":1}")).unwrap();
    let m = MetaFiles::new();
    assert_eq!(m.read(&p), MetaRead::Current(b"{\"v\":2}".to_vec()));
    m.overwrite(&p, b"{\"v\":3}", false).unwrap();
    assert_eq!(
        std::fs::read(&p).unwrap(),
        v1(b"{\"v\":2}"),
        "the old copy is kept"
    );
    assert_eq!(m.read(&p), MetaRead::Current(b"{\"v\":3}".to_vec()));
    // Damage to the new copy: the old one is what is left.
    std::fs::write(d.0.join("state.json.alt"), b"KEELMETA2 x").unwrap();
    assert!(
        matches!(MetaFiles::new().read(&p), MetaRead::Older { body, .. } if body == b"{\"v\":2}")
    );
    // An interrupted write of the older Keel (a good `.tmp`, the current copy damaged).
    std::fs::write(&p, b"KEELMETA1 zz").unwrap();
    std::fs::write(d.0.join("state.json.tmp"), v1(b"{\"v\":4}")).unwrap();
    assert!(
        matches!(MetaFiles::new().read(&p), MetaRead::Older { body, .. } if body == b"{\"v\":4}")
    );
    // The next process's first write finishes it rather than writing over it.
    let m = MetaFiles::new();
    m.overwrite(&p, b"{\"v\":5}", false).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), v1(b"{\"v\":4}"));
    assert_eq!(m.read(&p), MetaRead::Current(b"{\"v\":5}".to_vec()));
}

/// The same for a file replaced by rename (`.prev` is the older copy).
#[test]
fn damaged_renamed_file_falls_back_to_the_previous_copy() {
    let d = TempDir::new();
    let m = MetaFiles::new();
    let p = d.0.join("state.json");
    m.write(&p, br#"{"delivered":4000}"#, true).unwrap();
    m.write(&p, br#"{"delivered":5000}"#, true).unwrap();
    let mut b = std::fs::read(&p).unwrap();
    let at = b.windows(4).position(|w| w == b"5000").unwrap();
    b[at] = b'7';
    std::fs::write(&p, &b).unwrap();
    match m.read(&p) {
        MetaRead::Older { body, damage } => {
            assert_eq!(body, br#"{"delivered":4000}"#);
            assert!(damage.contains("checksum"), "{damage}");
        }
        other => panic!("{other:?}"),
    }
    // Writing again does not replace the good fallback with the damaged copy.
    m.write(&p, br#"{"delivered":6000}"#, false).unwrap();
    std::fs::write(&p, b"garbage").unwrap();
    match m.read(&p) {
        MetaRead::Older { body, .. } => assert_eq!(body, br#"{"delivered":4000}"#),
        other => panic!("{other:?}"),
    }
    std::fs::write(d.0.join("state.json.prev"), b"junk").unwrap();
    assert!(matches!(m.read(&p), MetaRead::Damaged(_)));
    assert_eq!(m.read(&d.0.join("nothing.json")), MetaRead::Missing);
}

/// A filesystem whose fsyncs of files under `stall` wait until the test lets them go.
struct StallFs {
    inner: SimFs,
    stall: PathBuf,
    entered: std::sync::mpsc::SyncSender<()>,
    release: Arc<Mutex<std::sync::mpsc::Receiver<()>>>,
}

struct StallFile {
    inner: Box<dyn crate::io::FsFile>,
    stalls: bool,
    entered: std::sync::mpsc::SyncSender<()>,
    release: Arc<Mutex<std::sync::mpsc::Receiver<()>>>,
}

impl crate::io::Fs for StallFs {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        self.inner.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn open(&self, path: &Path, create: bool) -> std::io::Result<Box<dyn crate::io::FsFile>> {
        Ok(Box::new(StallFile {
            inner: self.inner.open(path, create)?,
            stalls: path.starts_with(&self.stall),
            entered: self.entered.clone(),
            release: self.release.clone(),
        }))
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        self.inner.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.inner.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.inner.sync_dir(dir)
    }
    fn remove_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        self.inner.remove_dir_all(dir)
    }
    fn lock(&self, dir: &Path) -> std::io::Result<Box<dyn Send>> {
        self.inner.lock(dir)
    }
}

impl crate::io::FsFile for StallFile {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, off)
    }
    fn write_at(&mut self, buf: &[u8], off: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, off)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        if self.stalls {
            let _ = self.entered.send(());
            let _ = self.release.lock().unwrap().recv();
        }
        self.inner.sync()
    }
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        self.inner.truncate(len)
    }
    fn allocate(&mut self, len: u64, write_zeros: bool) -> std::io::Result<()> {
        self.inner.allocate(len, write_zeros)
    }
}

/// One file's fsync does not hold up another file's write or fsync: consumers confirming
/// acks at the same time sync side by side (each file has its own lock), while
/// `make_durable_under` still syncs what was written without fsync.
#[test]
fn one_files_fsync_does_not_hold_up_another_file() {
    let (entered_tx, entered) = std::sync::mpsc::sync_channel(8);
    let (release, release_rx) = std::sync::mpsc::channel();
    let sim = SimFs::new(7);
    let fast_meta = Path::new("/c/fast/meta");
    let m = MetaFiles::with_fs(Arc::new(StallFs {
        inner: sim.clone(),
        stall: PathBuf::from("/c/slow"),
        entered: entered_tx,
        release: Arc::new(Mutex::new(release_rx)),
    }));
    let (slow, fast) = (Path::new("/c/slow/state"), Path::new("/c/fast/state"));
    // Slots made (their first writes) before the stall.
    release.send(()).unwrap();
    m.overwrite(slow, b"{\"v\":0}", true).unwrap();
    entered.recv().unwrap();
    m.overwrite(fast, b"{\"v\":0}", true).unwrap();
    let m2 = m.clone();
    let writer =
        std::thread::spawn(move || m2.overwrite(Path::new("/c/slow/state"), b"{\"v\":1}", true));
    entered
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the slow file's fsync started");
    // While it waits: another file is written, synced and read.
    let (done_tx, done) = std::sync::mpsc::channel();
    let m3 = m.clone();
    std::thread::spawn(move || {
        let r = m3.overwrite(Path::new("/c/fast/state"), b"{\"v\":1}", true);
        let r2 = m3.overwrite(Path::new("/c/fast/state"), b"{\"v\":2}", false);
        let n = m3.make_durable_under(Path::new("/c/fast"));
        let _ = done_tx.send((r.is_ok(), r2.is_ok(), n.ok()));
    });
    let got = done.recv_timeout(std::time::Duration::from_secs(10));
    release.send(()).unwrap();
    writer.join().unwrap().unwrap();
    assert_eq!(
        got.expect("another file's writes waited for the stalled fsync"),
        (true, true, Some(1))
    );
    assert!(matches!(m.read(fast), MetaRead::Current(b) if b == b"{\"v\":2}"));
    assert!(matches!(m.read(slow), MetaRead::Current(b) if b == b"{\"v\":1}"));
    // The same for files replaced by rename (configs): a stalled one holds up no other.
    let m2 = m.clone();
    let writer =
        std::thread::spawn(move || m2.write(Path::new("/c/slow/meta"), b"{\"c\":1}", true));
    entered
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the slow config's fsync started");
    let (done_tx, done) = std::sync::mpsc::channel();
    let m3 = m.clone();
    std::thread::spawn(move || {
        let r = m3.write(Path::new("/c/fast/meta"), b"{\"c\":1}", false);
        let n = m3.make_durable_under(Path::new("/c/fast"));
        let _ = done_tx.send((r.is_ok(), n.ok()));
    });
    let got = done.recv_timeout(std::time::Duration::from_secs(10));
    release.send(()).unwrap();
    writer.join().unwrap().unwrap();
    assert_eq!(
        got.expect("another config's write waited for the stalled fsync"),
        (true, Some(1))
    );
    // What make_durable_under synced survives a crash.
    sim.crash(0);
    let m = MetaFiles::with_fs(Arc::new(sim));
    assert!(matches!(m.read(fast), MetaRead::Current(b) if b == b"{\"v\":2}"));
    assert!(matches!(m.read(fast_meta), MetaRead::Current(b) if b == b"{\"c\":1}"));
}

/// `retire_dir` (a stream's or consumer's removal) under failing operations and power
/// failures: the directory is either there whole under its own name (the removal did not
/// start, or failed before its rename) or gone from that name, never left there in part;
/// whatever is left elsewhere is under a name `is_retired` knows.
#[test]
fn a_retired_directory_never_comes_back_in_part() {
    let dir = Path::new("/s/ORDERS");
    let files = [
        "meta.json",
        "1.blk",
        "consumers/W/meta.json",
        "consumers/W/state.json",
    ];
    let mut retired_left = 0;
    for seed in 0..super::sim::cases(500) {
        let sim = SimFs::new(seed);
        let m = MetaFiles::with_fs(Arc::new(sim.clone()));
        for f in files {
            m.write(&dir.join(f), b"{\"x\":1}", true).unwrap();
        }
        let mut rng = Rng(seed);
        if rng.chance(2) {
            sim.fail_after(rng.below(4));
        }
        let r = m.retire_dir(dir);
        if rng.chance(2) {
            sim.crash(0);
        } else {
            sim.heal();
        }
        let names = sim.names();
        let here: Vec<&PathBuf> = names.iter().filter(|p| p.starts_with(dir)).collect();
        assert!(
            here.is_empty() || files.iter().all(|f| names.contains(&dir.join(f))),
            "seed {seed}: {r:?} left part of it: {here:?}"
        );
        assert!(r.is_err() || here.is_empty(), "seed {seed}: still there");
        for p in names.iter().filter(|p| !p.starts_with(dir)) {
            let top = p
                .ancestors()
                .find(|a| a.parent() == Some(Path::new("/s")))
                .unwrap();
            assert!(MetaFiles::is_retired(top), "seed {seed}: {p:?}");
            retired_left += 1;
        }
    }
    assert!(retired_left > 0, "no case left a retired directory behind");
}

/// A name as long as a file name may be (255 bytes) is retired too: the retired name is
/// not longer than the filesystem allows.
#[test]
fn a_directory_with_the_longest_name_is_retired() {
    let t = TempDir::new();
    let m = MetaFiles::new();
    for name in ["C".repeat(255), "é".repeat(127)] {
        let dir = t.0.join(&name);
        m.write(&dir.join("meta.json"), b"{}", true).unwrap();
        let gone = m.retire(&dir).unwrap().expect("there was a directory");
        assert!(MetaFiles::is_retired(&gone), "{gone:?}");
        assert!(!dir.exists() && gone.exists());
        std::fs::remove_dir_all(&gone).unwrap();
        m.write(&dir.join("meta.json"), b"{}", true).unwrap();
        m.retire_dir(&dir).unwrap();
        assert_eq!(std::fs::read_dir(&t.0).unwrap().count(), 0);
    }
    assert_eq!(m.retire(&t.0.join("none")).unwrap(), None);
}
