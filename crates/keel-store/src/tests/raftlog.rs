//! The Raft log: unit tests, and power failures at random points on the simulated
//! filesystem. After every recovery (without bit flips): no problem is reported; the purge
//! point and the saved state are the last ones that returned; every entry synced (a
//! `finish_sync` returned, or it was durable at the last recovery) and not truncated since
//! is there with its content; the log is contiguous and any entry past the synced ones is
//! one that was appended (never an older one a truncation removed). With bit flips, the
//! log may end earlier, but every entry served is one that was appended there.
//!
//! Cases are seeded; a failure prints the seed. `KEEL_SIM_CASES` sets how many run.

use super::sim::{Rng, SimFs};
use crate::raftlog::{RaftLog, RaftLogConfig};
use crate::StoreError;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn open(sim: &SimFs, dir: &Path, seg: u64) -> (RaftLog, Vec<String>) {
    RaftLog::open_fs(
        Arc::new(sim.clone()),
        dir,
        RaftLogConfig {
            segment_size: seg,
            ..RaftLogConfig::default()
        },
    )
    .unwrap()
}

fn payload(i: u64, salt: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (i.wrapping_mul(31) ^ salt ^ k as u64) as u8)
        .collect()
}

fn append_n(log: &mut RaftLog, from: u64, n: u64, len: usize) {
    let ps: Vec<Vec<u8>> = (from..from + n).map(|i| payload(i, 0, len)).collect();
    let es: Vec<(u64, &[u8])> = ps
        .iter()
        .enumerate()
        .map(|(k, p)| (from + k as u64, &p[..]))
        .collect();
    log.append(&es).unwrap();
}

fn all(log: &RaftLog) -> Vec<(u64, Vec<u8>)> {
    log.entries(log.first_index()..=log.last_index())
        .unwrap()
        .into_iter()
        .map(|(i, b)| (i, b.to_vec()))
        .collect()
}

fn segs(sim: &SimFs) -> Vec<PathBuf> {
    sim.names()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rlog"))
        .collect()
}

#[test]
fn append_sync_reopen() {
    let sim = SimFs::new(1);
    let dir = Path::new("/g1");
    let (mut log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty());
    assert_eq!((log.first_index(), log.last_index()), (1, 0));
    assert_eq!(log.last_entry().unwrap(), None);
    // Not the next index: refused, nothing written.
    assert!(matches!(
        log.append(&[(2, b"x")]),
        Err(StoreError::Sequence { seq: 2, last: 0 })
    ));
    append_n(&mut log, 1, 100, 100);
    assert!(segs(&sim).len() > 1, "rolls segments");
    let before = sim.syncs();
    log.sync().unwrap();
    // One fsync per segment written and one for the directory, whatever the appends.
    assert!(sim.syncs() - before <= segs(&sim).len() as u64 + 1);
    let want = all(&log);
    assert_eq!(want.len(), 100);
    assert_eq!(want[41], (42, payload(42, 0, 100)));
    let got = log.entries(10..=12).unwrap();
    assert_eq!(
        got.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![10, 11, 12]
    );
    assert_eq!(log.entries(99..=500).unwrap().len(), 2, "clamped");
    drop(log);
    sim.crash(0);
    let (log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty(), "{p:?}");
    assert_eq!(all(&log), want);
    assert_eq!(log.last_entry().unwrap().unwrap().0, 100);
}

#[test]
fn real_filesystem_round_trip() {
    let dir = std::env::temp_dir().join(format!("keel-raftlog-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut log, p) = RaftLog::open(&dir).unwrap();
    assert!(p.is_empty());
    log.append(&[(1, b"one"), (2, b"two")]).unwrap();
    let mut job = log.begin_sync().unwrap().unwrap();
    job.run();
    log.finish_sync(job).unwrap();
    log.save_state(b"vote").unwrap();
    drop(log);
    let (log, p) = RaftLog::open(&dir).unwrap();
    assert!(p.is_empty());
    assert_eq!(all(&log), vec![(1, b"one".to_vec()), (2, b"two".to_vec())]);
    assert_eq!(log.load_state().as_deref(), Some(&b"vote"[..]));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncate_then_append() {
    let sim = SimFs::new(2);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 4096);
    append_n(&mut log, 1, 80, 100);
    log.sync().unwrap();
    let n = segs(&sim).len();
    log.truncate_after(30).unwrap();
    assert_eq!(log.last_index(), 30);
    assert!(segs(&sim).len() < n, "whole segments after 30 removed");
    // Appends continue at 31, with new content.
    log.append(&[(31, b"new31"), (32, b"new32")]).unwrap();
    // Durable without a sync: the truncation itself; the new entries are not synced.
    drop(log);
    sim.crash(0);
    let (mut log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty(), "{p:?}");
    let got = all(&log);
    assert!(got.len() >= 30 && got.len() <= 32);
    assert_eq!(got[29], (30, payload(30, 0, 100)));
    if got.len() > 30 {
        assert_eq!(
            got[30],
            (31, b"new31".to_vec()),
            "never the truncated entry"
        );
    }
    let last = log.last_index();
    log.truncate_after(last).unwrap();
    log.truncate_after(10).unwrap();
    assert_eq!(log.last_index(), 10);
    append_n(&mut log, 11, 5, 10);
    log.sync().unwrap();
    drop(log);
    sim.crash(0);
    let (log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty(), "{p:?}");
    assert_eq!(log.last_index(), 15);
    assert_eq!(all(&log)[14], (15, payload(15, 0, 10)));
}

#[test]
fn purge_then_reopen() {
    let sim = SimFs::new(3);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 4096);
    append_n(&mut log, 1, 100, 100);
    log.sync().unwrap();
    let n = segs(&sim).len();
    log.purge_upto(50).unwrap();
    assert_eq!((log.first_index(), log.purged_upto()), (51, 50));
    assert!(segs(&sim).len() < n, "purged segments removed");
    assert_eq!(log.entries(1..=52).unwrap().len(), 2);
    assert!(log.truncate_after(40).is_err(), "below the purge point");
    drop(log);
    sim.crash(0);
    let (mut log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty(), "{p:?}");
    assert_eq!((log.first_index(), log.last_index()), (51, 100));
    assert_eq!(all(&log)[0], (51, payload(51, 0, 100)));
    // Past the end: the log is empty and continues after the purge point.
    log.purge_upto(200).unwrap();
    assert_eq!((log.first_index(), log.last_index()), (201, 200));
    assert!(segs(&sim).is_empty());
    assert!(log.append(&[(101, b"x")]).is_err());
    log.append(&[(201, b"x")]).unwrap();
    log.sync().unwrap();
    drop(log);
    sim.crash(0);
    let (log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty(), "{p:?}");
    assert_eq!(log.purged_upto(), 200);
    assert_eq!(all(&log), vec![(201, b"x".to_vec())]);
}

#[test]
fn damaged_record_is_reported_and_never_served() {
    let sim = SimFs::new(4);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 1 << 20);
    append_n(&mut log, 1, 20, 50);
    log.sync().unwrap();
    append_n(&mut log, 21, 5, 50);
    log.sync().unwrap();
    let seg = segs(&sim)[0].clone();
    // Entry 8's payload: 112 bytes of heads, then 74-byte records.
    let off = 112 + 7 * 74 + 30;
    sim.scribble(&seg, off, &[0xff]);
    // A read of the damaged entry is an error, never the bytes.
    let e = log.entries(7..=9).unwrap_err();
    assert!(e.to_string().contains("entry 8 is damaged"), "{e}");
    drop(log);
    sim.crash(0);
    let (log, p) = open(&sim, dir, 1 << 20);
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(
        p[0].contains("entry 8 ") && p[0].contains("up to 25"),
        "{p:?}"
    );
    // The heads prove entries up to 20 synced (the last sync's own are proven by the next).
    assert!(p[1].contains("8..=20") && p[1].contains("missing"), "{p:?}");
    assert_eq!(log.last_index(), 7, "the log ends before the damaged entry");
    assert_eq!(all(&log).len(), 7);
    // It forgot entries it had made durable, up to what the heads claim.
    assert_eq!(log.lost(), Some(20));
    // The rest is kept for the operator.
    assert!(sim
        .names()
        .iter()
        .any(|n| n.to_string_lossy().contains("damaged-")));
    drop(log);
    // Reported once: the cut is durable and the heads no longer claim the entries.
    let (log, p) = open(&sim, dir, 1 << 20);
    assert!(p.is_empty(), "{p:?}");
    // (What it lost is known only to the run that found it: the server keeps the guard.)
    assert_eq!(log.lost(), None);
}

#[test]
fn missing_segment_is_reported() {
    let sim = SimFs::new(5);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 4096);
    append_n(&mut log, 1, 100, 100);
    log.sync().unwrap();
    // Heads prove what the sync before theirs made durable.
    append_n(&mut log, 101, 1, 100);
    log.sync().unwrap();
    let s = segs(&sim);
    assert!(s.len() >= 3);
    drop(log);
    sim.lose(&s[1]);
    let (log, p) = open(&sim, dir, 4096);
    assert!(p.iter().any(|m| m.contains("missing")), "{p:?}");
    let first_of_next: u64 = s[1].file_stem().unwrap().to_str().unwrap().parse().unwrap();
    assert_eq!(log.last_index(), first_of_next - 1);
}

#[test]
fn synced_bytes_missing_at_the_end_are_reported() {
    let sim = SimFs::new(5);
    let dir = Path::new("/g");
    // Not preallocated: the file then ends at its last record, which the chop below cuts.
    let cfg = RaftLogConfig {
        segment_size: 1 << 20,
        preallocate: false,
        ..Default::default()
    };
    let (mut log, _) = RaftLog::open_fs(Arc::new(sim.clone()), dir, cfg).unwrap();
    append_n(&mut log, 1, 5, 100);
    log.sync().unwrap();
    append_n(&mut log, 6, 1, 100);
    log.sync().unwrap();
    drop(log);
    let l = segs(&sim)[0].clone();
    let len = sim
        .dump()
        .into_iter()
        .find(|(p, _)| p == &l)
        .unwrap()
        .1
        .len();
    // Into entry 5, which the last sync's head proves durable.
    sim.chop(&l, len - 150);
    let (log, p) = open(&sim, dir, 1 << 20);
    assert!(p[0].contains("synced bytes missing"), "{p:?}");
    assert!(p.last().unwrap().contains("5..=5"), "{p:?}");
    assert_eq!(log.last_index(), 4);
}

#[test]
fn torn_tail_is_cut_silently() {
    for seed in 0..40 {
        let sim = SimFs::new(seed);
        let dir = Path::new("/g");
        let (mut log, _) = open(&sim, dir, 1 << 20);
        append_n(&mut log, 1, 10, 200);
        log.sync().unwrap();
        // Not synced: a power failure keeps any prefix of these writes, maybe torn.
        for i in 11..=20 {
            log.append(&[(i, &payload(i, 0, 200))]).unwrap();
        }
        drop(log);
        sim.crash(0);
        let (mut log, p) = open(&sim, dir, 1 << 20);
        assert!(p.is_empty(), "seed {seed}: {p:?}");
        let got = all(&log);
        assert!(got.len() >= 10, "seed {seed}");
        for (i, b) in &got {
            assert_eq!(b, &payload(*i, 0, 200), "seed {seed}");
        }
        // The log continues right after what survived.
        let next = log.last_index() + 1;
        log.append(&[(next, b"more")]).unwrap();
        log.sync().unwrap();
        drop(log);
        sim.crash(0);
        let (log, p) = open(&sim, dir, 1 << 20);
        assert!(p.is_empty(), "seed {seed}: {p:?}");
        assert_eq!(log.last_entry().unwrap().unwrap().1.as_ref(), b"more");
    }
}

#[test]
fn appends_continue_during_a_sync() {
    let sim = SimFs::new(6);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 4096);
    append_n(&mut log, 1, 10, 100);
    let mut job = log.begin_sync().unwrap().unwrap();
    assert!(log.begin_sync().is_err(), "one sync at a time");
    append_n(&mut log, 11, 30, 100);
    assert!(log.truncate_after(5).is_err(), "not during a sync");
    assert_eq!(log.entries(1..=40).unwrap().len(), 40);
    job.run();
    log.finish_sync(job).unwrap();
    // The appends made during the sync wait for the next one.
    assert!(log.begin_sync().unwrap().is_some());
}

#[test]
fn purge_during_a_sync() {
    let sim = SimFs::new(8);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 4096);
    append_n(&mut log, 1, 60, 100);
    let mut job = log.begin_sync().unwrap().unwrap();
    // Everything goes, the segments the job holds included.
    log.purge_upto(60).unwrap();
    assert!(segs(&sim).is_empty());
    job.run();
    log.finish_sync(job).unwrap();
    log.append(&[(61, b"after")]).unwrap();
    log.sync().unwrap();
    drop(log);
    sim.crash(0);
    let (log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty(), "{p:?}");
    assert_eq!((log.first_index(), log.last_index()), (61, 61));
}

#[test]
fn log_and_job_move_between_threads() {
    fn send<T: Send + 'static>() {}
    send::<RaftLog>();
    send::<crate::RaftSyncJob>();
}

#[test]
fn state_is_saved_durably() {
    let sim = SimFs::new(7);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 4096);
    assert_eq!(log.load_state(), None);
    log.save_state(b"term 3 vote 2").unwrap();
    log.save_state(b"term 4 vote 1").unwrap();
    drop(log);
    sim.crash(0);
    let (log, p) = open(&sim, dir, 4096);
    assert!(p.is_empty());
    assert_eq!(log.load_state().as_deref(), Some(&b"term 4 vote 1"[..]));
    assert_eq!(log.lost(), None);
    drop(log);
    // A damaged state file: the vote may be forgotten, so the log says it lost something.
    let state = sim
        .names()
        .into_iter()
        .find(|n| n.file_name().is_some_and(|f| f == "state"))
        .unwrap();
    sim.scribble(&state, 2, &[0xff]);
    let (log, p) = open(&sim, dir, 4096);
    assert!(!p.is_empty());
    assert!(log.lost().is_some(), "{p:?}");
}

/// What the checker knows: the content appended at each index (current), and what is
/// durable.
struct Case {
    rng: Rng,
    sim: SimFs,
    dir: PathBuf,
    seg: u64,
    log: Option<RaftLog>,
    seed: u64,
    /// The log as it is (in memory): purge point and entries above it.
    purged: u64,
    cur: BTreeMap<u64, Vec<u8>>,
    /// Entries up to here are durable (synced and not truncated since).
    acked: u64,
    state: Option<Vec<u8>>,
    flipped: bool,
    /// Purged entries (damage to the purge point may bring them back).
    gone: BTreeMap<u64, Vec<u8>>,
}

#[derive(Default, Debug)]
struct Stats {
    crashes: u64,
    syncs: u64,
    split_syncs: u64,
    truncates: u64,
    purges: u64,
    failures: u64,
    problems: u64,
    checked: u64,
}

impl Case {
    fn l(&mut self) -> &mut RaftLog {
        self.log.as_mut().unwrap()
    }

    fn last(&self) -> u64 {
        self.cur
            .keys()
            .next_back()
            .copied()
            .unwrap_or(0)
            .max(self.purged)
    }

    fn append(&mut self) -> bool {
        let n = 1 + self.rng.below(5);
        let from = self.last() + 1;
        let ps: Vec<Vec<u8>> = (0..n)
            .map(|_| {
                let len = self.rng.below(300) as usize;
                payload(from, self.rng.next(), len)
            })
            .collect();
        let es: Vec<(u64, &[u8])> = ps
            .iter()
            .enumerate()
            .map(|(k, p)| (from + k as u64, &p[..]))
            .collect();
        let r = self.l().append(&es);
        // Written or not, an entry is only "maybe there" until synced.
        for (k, p) in ps.into_iter().enumerate() {
            self.cur.insert(from + k as u64, p);
        }
        r.is_ok()
    }

    fn sync(&mut self, stats: &mut Stats) -> bool {
        let covered = self.last();
        let r = if self.rng.chance(2) {
            stats.split_syncs += 1;
            match self.l().begin_sync() {
                Ok(Some(mut job)) => {
                    // Appends while the fsync runs are not covered by it.
                    if self.rng.chance(2) && !self.append() {
                        return false;
                    }
                    job.run();
                    self.l().finish_sync(job)
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            }
        } else {
            self.l().sync()
        };
        if r.is_ok() {
            self.acked = covered;
            stats.syncs += 1;
        }
        r.is_ok()
    }

    fn crash(&mut self, stats: &mut Stats) {
        drop(self.log.take());
        let flips = if self.rng.chance(8) {
            1 + self.rng.below(3) as usize
        } else {
            0
        };
        if self.sim.crash(flips).flipped > 0 {
            self.flipped = true;
        }
        stats.crashes += 1;
        self.recover(stats);
    }

    fn recover(&mut self, stats: &mut Stats) {
        let seed = self.seed;
        let (log, problems) = open(&self.sim, &self.dir, self.seg);
        stats.problems += !problems.is_empty() as u64;
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            for (n, d) in self.sim.dump() {
                if !n.to_string_lossy().ends_with(".rlog") {
                    eprintln!("   {}: {:?}", n.display(), String::from_utf8_lossy(&d));
                }
            }
        }
        let got = all(&log);
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            eprintln!(
                "recovered first {} last {} problems {problems:?}; files {:?}",
                log.first_index(),
                log.last_index(),
                self.sim
                    .dump()
                    .iter()
                    .map(|(n, d)| (n.clone(), d.len()))
                    .collect::<Vec<_>>()
            );
        }
        // Contiguous from the first index, whatever happened.
        for (k, (i, _)) in got.iter().enumerate() {
            assert_eq!(*i, log.first_index() + k as u64, "seed {seed}: contiguous");
        }
        assert_eq!(log.last_index() + 1 - log.first_index(), got.len() as u64);
        // Every entry served is one appended there (never damaged, never a truncated one;
        // a purged one only when damage took the purge point).
        for (i, b) in &got {
            let purged = self.flipped && self.gone.get(i) == Some(b);
            assert_eq!(
                self.cur.get(i).or(purged.then_some(b)),
                Some(b),
                "seed {seed}: entry {i} content (flipped {})",
                self.flipped
            );
        }
        if !self.flipped {
            assert!(problems.is_empty(), "seed {seed}: {problems:?}");
            assert_eq!(
                log.lost(),
                None,
                "seed {seed}: a crash alone forgets nothing"
            );
            assert_eq!(log.purged_upto(), self.purged, "seed {seed}: purge point");
            assert_eq!(log.load_state(), self.state, "seed {seed}: state");
            assert!(
                log.last_index() >= self.acked,
                "seed {seed}: synced entries up to {} lost, log ends at {}",
                self.acked,
                log.last_index()
            );
            stats.checked += self.acked.saturating_sub(self.purged);
        }
        // What recovery found is durable now (it syncs what it keeps).
        self.purged = log.purged_upto();
        self.state = log.load_state();
        self.cur = got.into_iter().collect();
        self.acked = log.last_index();
        self.flipped = false;
        self.log = Some(log);
    }

    fn step(&mut self, stats: &mut Stats) {
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            eprintln!(
                "step: purged {} last {} acked {}",
                self.purged,
                self.last(),
                self.acked
            );
        }
        let op = self.rng.below(100);
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            eprintln!("op {op}");
        }
        match op {
            0..=39 => {
                self.append();
            }
            40..=59 => {
                self.sync(stats);
            }
            60..=64 => {
                let (lo, hi) = (self.purged, self.last());
                let t = lo + self.rng.below(hi - lo + 1);
                self.l().truncate_after(t).unwrap();
                stats.truncates += 1;
                self.cur.retain(|&i, _| i <= t);
                self.acked = self.acked.min(t);
            }
            65..=68 => {
                let p = self.purged + self.rng.below(self.last() + 3 - self.purged);
                self.l().purge_upto(p).unwrap();
                stats.purges += 1;
                if p > self.purged {
                    self.purged = p;
                    let kept = self.cur.split_off(&(p + 1));
                    self.gone.extend(std::mem::replace(&mut self.cur, kept));
                    self.acked = self.acked.max(p);
                }
            }
            69..=71 => {
                let s = payload(self.rng.next(), 7, 20);
                if std::env::var_os("KEEL_SIM_TRACE").is_some() {
                    eprintln!("save_state {s:?}");
                }
                self.l().save_state(&s).unwrap();
                self.state = Some(s);
            }
            72..=79 => {
                let (lo, hi) = (self.purged + 1, self.last());
                if lo <= hi {
                    let a = lo + self.rng.below(hi - lo + 1);
                    let b = a + self.rng.below(hi - a + 1);
                    let got = self.l().entries(a..=b).unwrap();
                    assert_eq!(got.len() as u64, b - a + 1, "seed {}", self.seed);
                    for (i, v) in got {
                        assert_eq!(self.cur.get(&i).map(|x| &x[..]), Some(&v[..]));
                    }
                }
            }
            80..=89 => self.crash(stats),
            90..=92 => {
                // A process restart without a power failure (the page cache survives).
                drop(self.log.take());
                self.recover(stats);
            }
            _ => {
                // I/O starts failing part-way through appends and syncs; then the power
                // goes. Nothing that failed was acknowledged.
                stats.failures += 1;
                self.sim.fail_after(self.rng.below(12));
                for _ in 0..4 {
                    if !self.append() || !self.sync(stats) {
                        break;
                    }
                }
                self.crash(stats);
            }
        }
    }
}

fn run_case(seed: u64, stats: &mut Stats) {
    let mut rng = Rng(seed);
    let seg = 4096 + rng.below(4096);
    let sim = SimFs::new(seed);
    let mut c = Case {
        rng,
        sim,
        dir: PathBuf::from("/raft/g1"),
        seg,
        log: None,
        seed,
        purged: 0,
        cur: BTreeMap::new(),
        acked: 0,
        state: None,
        flipped: false,
        gone: BTreeMap::new(),
    };
    c.recover(stats);
    let ops = 50 + c.rng.below(250);
    for _ in 0..ops {
        c.step(stats);
    }
    c.crash(stats);
}

#[test]
fn raft_log_survives_power_failures() {
    let seeds = super::sim::seeds(1000);
    let cases = seeds.end - seeds.start;
    let mut stats = Stats::default();
    for seed in seeds {
        run_case(seed, &mut stats);
    }
    eprintln!("{stats:?}");
    assert!(stats.crashes > cases && stats.syncs > cases && stats.split_syncs > 0);
    assert!(stats.truncates > 0 && stats.purges > 0 && stats.failures > 0);
    assert!(stats.problems > 0, "bit flips must be caught");
}

/// The active segment is allocated ahead of its records (zeros, so that its fdatasyncs do
/// not change the file's size); a segment followed by another ends at its last record (cut
/// back, durably, when the next one started); reopening after a power failure finds every
/// synced entry and reports nothing, and cuts the zeros.
#[test]
fn the_active_segment_is_allocated_ahead_and_cut_back_when_rolled() {
    let sim = SimFs::new(9);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 64 << 10);
    let lens = |sim: &SimFs| -> Vec<usize> {
        let names = segs(sim);
        sim.dump()
            .into_iter()
            .filter(|(p, _)| names.contains(p))
            .map(|(_, d)| d.len())
            .collect()
    };
    append_n(&mut log, 1, 10, 100);
    log.sync().unwrap();
    let one = lens(&sim);
    assert_eq!(one.len(), 1);
    // Two heads of 56 bytes and ten records of 124: allocated ahead of 1,352 bytes.
    assert!(one[0] > 2 * 56 + 10 * 124, "{one:?}");
    // Past the first segment's 64 KiB: it is cut back to its records.
    append_n(&mut log, 11, 600, 100);
    log.sync().unwrap();
    let many = lens(&sim);
    assert!(many.len() > 1, "{many:?}");
    for (k, len) in many[..many.len() - 1].iter().enumerate() {
        assert_eq!(
            (len - 2 * 56) % 124,
            0,
            "segment {k} ends in zeros: {many:?}"
        );
    }
    let want = all(&log);
    drop(log);
    sim.crash(0);
    let (log, p) = open(&sim, dir, 64 << 10);
    assert!(p.is_empty(), "{p:?}");
    assert_eq!(all(&log), want);
    let last = *lens(&sim).last().unwrap();
    assert_eq!(
        (last - 2 * 56) % 124,
        0,
        "the zeros are cut at recovery: {last}"
    );
}

/// A Raft log's small appends allocate ahead with zeros written (their fdatasync then
/// flushes data only); an append of 256 KiB or more with fallocate.
#[test]
fn small_appends_allocate_with_zeros_large_ones_with_fallocate() {
    let sim = SimFs::new(10);
    let dir = Path::new("/g");
    let (mut log, _) = open(&sim, dir, 64 << 20);
    let base = sim.allocations();
    append_n(&mut log, 1, 1, 100);
    let small = sim.allocations();
    assert_eq!(
        (small.0 - base.0, small.1 - base.1),
        (1, 0),
        "{base:?} -> {small:?}"
    );
    append_n(&mut log, 2, 1, 300 << 10);
    let large = sim.allocations();
    assert_eq!(
        (large.0 - small.0, large.1 - small.1),
        (0, 1),
        "{small:?} -> {large:?}"
    );
}

/// `Disk::fillable` (the server's tests fill one server's disk with it) acts as ext4 with
/// no free block: appends go on into the space allocated ahead, then fail with ENOSPC;
/// once there is room again, the reopened log has every entry synced before.
#[test]
fn a_full_disk_refuses_appends_past_the_allocated_space_and_keeps_what_was_synced() {
    let tmp = super::file_tests::TempDir::new();
    let dir = tmp.0.join("log");
    let (disk, full) = crate::Disk::fillable();
    let cfg = RaftLogConfig {
        disk,
        ..RaftLogConfig::default()
    };
    let (mut log, _) = RaftLog::open_with(&dir, cfg.clone()).unwrap();
    append_n(&mut log, 1, 10, 1000);
    log.sync().unwrap();
    full.fill(&dir);
    let mut next = 11;
    let err = loop {
        let p = payload(next, 0, 1000);
        let r = log.append(&[(next, &p[..])]).and_then(|()| log.sync());
        match r {
            Ok(()) => next += 1,
            Err(e) => break e,
        }
        assert!(next < 10_000, "a full disk took 10 MB");
    };
    assert!(err.to_string().contains("No space left"), "{err}");
    // The allocated space took some: a full disk does not stop a log at once.
    assert!(next > 11, "no append into the allocated space");
    drop(log);

    // Still full: opening works (recovery needs no new block) and keeps what was synced.
    let (log, problems) = RaftLog::open_with(&dir, cfg.clone()).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(log.last_index(), next - 1);
    drop(log);

    full.free();
    let (mut log, _) = RaftLog::open_with(&dir, cfg).unwrap();
    let want: Vec<(u64, Vec<u8>)> = (1..next).map(|i| (i, payload(i, 0, 1000))).collect();
    assert_eq!(all(&log), want);
    append_n(&mut log, next, 300, 1000);
    log.sync().unwrap();
    assert_eq!(log.last_index(), next + 299);
}

/// A log's directory has one open log at a time: a second open (a group loaded again while
/// its old node still winds down) is refused until the first is dropped, and then finds
/// everything the first synced.
#[test]
fn a_log_directory_has_one_open_log_at_a_time() {
    let tmp = super::file_tests::TempDir::new();
    let dir = tmp.0.join("log");
    let (mut log, _) = RaftLog::open(&dir).unwrap();
    append_n(&mut log, 1, 5, 100);
    log.sync().unwrap();
    let err = RaftLog::open(&dir)
        .err()
        .expect("a second open while the first is open");
    assert!(err.to_string().contains("in use"), "{err}");
    drop(log);
    let (log, problems) = RaftLog::open(&dir).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(log.last_index(), 5);
}
