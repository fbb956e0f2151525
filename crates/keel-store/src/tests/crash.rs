//! Fault injection: random workloads on the simulated filesystem with power failures,
//! torn writes, lost directory entries, bit flips and failing I/O. After every recovery:
//! (a) every message live at the last successful sync and not removed since is present
//!     with identical content;
//! (b) nothing present was never stored or was removed before the last successful sync
//!     (no resurrection), and nothing is ever returned with different content;
//! (c) recovery does not panic or fail, and with bit flips a damaged record is never served
//!     (it reads as absent or is reported lost) - only (a) and the no-resurrection half of
//!     (b) are relaxed once bits were flipped.
//!
//! Cases are seeded; a failure prints the seed. `KEEL_SIM_CASES` sets how many run.

use super::model::{hdr_bytes, payload, SUBJECTS};
use super::sim::{Rng, SimFs};
use crate::*;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

type Content = (Vec<u8>, Vec<u8>, Vec<u8>, i64);

#[derive(Default, Debug)]
struct Stats {
    cases: u64,
    ops: u64,
    syncs_ok: u64,
    crashes: u64,
    clean_restarts: u64,
    injected_failures: u64,
    used_index: u64,
    torn: u64,
    corrupt: u64,
    corrupt_unflipped: u64,
    erases: u64,
    flips: u64,
    flip_losses: u64,
    must_checked: u64,
    rollbacks: u64,
    data_losses: u64,
    reported_losses: u64,
    compactions: u64,
    compaction_crashes: u64,
}

struct Case {
    rng: Rng,
    sim: SimFs,
    dir: PathBuf,
    cfg: FileStoreConfig,
    limits: Limits,
    store: Option<FileStore>,
    /// Every message stored in this epoch (since the last recovery, plus what recovery
    /// kept), by sequence.
    all: HashMap<u64, Content>,
    /// Live at the last successful sync.
    synced: BTreeSet<u64>,
    /// Stored since the last successful sync (whatever became of them).
    since: BTreeSet<u64>,
    flipped: bool,
    /// Synced data was destroyed (a chopped or missing segment): what is gone must be
    /// reported, and removals may come undone.
    lossy: bool,
    /// What the last recovery reported.
    rep: RecoveryReport,
    /// A failed operation may have completed a sync of its own before failing (close
    /// syncs before writing the index, an erase syncs its tombstone first).
    maybe_synced: bool,
    failed: bool,
    /// The failure that set `failed` was a sync's that rolled back at once (it said so):
    /// the store takes writes again and the next sync has nothing to report.
    rolled_back: bool,
    seed: u64,
    /// last_seq as of the last successful sync: sequences up to it were handed out and
    /// acknowledged, so they must never be handed out again.
    synced_last: u64,
}

fn live(s: &FileStore) -> BTreeSet<u64> {
    let st = s.state();
    if st.msgs == 0 {
        return BTreeSet::new();
    }
    let del: BTreeSet<u64> = s.deleted().into_iter().collect();
    (st.first_seq..=st.last_seq)
        .filter(|q| !del.contains(q))
        .collect()
}

impl Case {
    fn open(&mut self, stats: &mut Stats) {
        // Recovery is checked without limits: if a lost (unsynced) removal leaves the stream
        // over max_msgs, opening with limits would rightly discard the oldest, acknowledged
        // or not. The limits are applied after the checks (`apply_limits`).
        let (s, rep) = loop {
            match FileStore::open_fs(
                Arc::new(self.sim.clone()),
                &self.dir,
                Limits::default(),
                self.cfg.clone(),
            ) {
                Ok(x) => break x,
                // An armed failure can hit recovery itself: that is one more crash.
                Err(StoreError::Io(e)) if e.contains("injected") => {
                    stats.crashes += 1;
                    self.trace(format_args!("recovery failed: {e}; CRASH"));
                    self.sim.crash(0);
                    self.dump();
                }
                Err(e) => panic!("seed {}: recovery failed: {e}", self.seed),
            }
        };
        self.trace(format_args!("opened {rep:?}"));
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            eprintln!("{}deleted {:?}", s.dump(), s.deleted());
        }
        stats.used_index += rep.used_index as u64;
        stats.torn += (rep.torn_bytes > 0) as u64;
        stats.corrupt += rep.corrupt_records;
        if !self.flipped {
            stats.corrupt_unflipped += rep.corrupt_records;
        }
        // The newest segment is never lost here, whatever a crash cut short: the sequence
        // reservation must not call it missing.
        assert_eq!(rep.segments_missing, None, "seed {}: {rep:?}", self.seed);
        if !self.flipped && !self.lossy {
            // Torn in-place erases leave damaged records, but never a lost message.
            assert!(rep.lost.is_empty(), "seed {}: {rep:?}", self.seed);
            assert!(rep.damaged.is_empty(), "seed {}: {rep:?}", self.seed);
        }
        self.rep = rep;
        self.store = Some(s);
        self.failed = false;
        self.rolled_back = false;
    }

    fn s(&mut self) -> &mut FileStore {
        self.store.as_mut().unwrap()
    }

    fn io<T>(&mut self, r: Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(StoreError::Io(e)) => {
                self.failed = true;
                self.rolled_back = e.ends_with("(writes since the last sync were rolled back)");
                None
            }
            Err(_) => None,
        }
    }

    /// Checks the recovered store against what was acknowledged; then starts a new epoch.
    fn verify(&mut self, must: &BTreeSet<u64>, allowed: &BTreeSet<u64>, stats: &mut Stats) {
        let seed = self.seed;
        let flipped = self.flipped;
        let s = self.store.as_ref().unwrap();
        let mut present = BTreeSet::new();
        for q in live(s) {
            match s.load(q) {
                Ok(m) => {
                    let want = self.all.get(&q).unwrap_or_else(|| {
                        panic!("seed {seed}: message {q} was never stored: {m:?}")
                    });
                    let got = (m.subject.to_vec(), m.hdr.to_vec(), m.data.to_vec(), m.ts);
                    assert_eq!(&got, want, "seed {seed}: content of {q}");
                    present.insert(q);
                }
                Err(StoreError::NotFound) if flipped => {}
                Err(e) => panic!("seed {seed}: live message {q} unreadable: {e}"),
            }
        }
        let st = s.state();
        let reported: BTreeSet<u64> = st
            .lost
            .iter()
            .flat_map(|l| l.msgs.iter().copied())
            .chain(self.rep.unacked.iter().flat_map(|&(a, b)| a..=b))
            .collect();
        for q in must {
            stats.must_checked += 1;
            if !present.contains(q) {
                if self.lossy && reported.contains(q) {
                    stats.reported_losses += 1;
                    continue;
                }
                assert!(
                    flipped,
                    "seed {seed}: acknowledged message {q} lost without a report: {:?}",
                    self.rep
                );
                stats.flip_losses += 1;
            }
        }
        if !flipped && !self.lossy {
            for q in &present {
                assert!(
                    allowed.contains(q),
                    "seed {seed}: message {q} came back after a synced removal"
                );
            }
        }
        // Walking with load_next sees the same messages.
        let mut walked = BTreeSet::new();
        let mut at = 0;
        while let Ok(m) = s.load_next(at, ">") {
            walked.insert(m.seq);
            at = m.seq + 1;
        }
        assert_eq!(walked, present, "seed {seed}: load_next walk");
        if !flipped {
            assert!(
                st.last_seq >= self.synced_last,
                "seed {seed}: last_seq went back to {} below {}",
                st.last_seq,
                self.synced_last
            );
            assert_eq!(st.msgs, present.len() as u64, "seed {seed}");
            if !self.lossy {
                assert!(st.lost.is_none(), "seed {seed}: {st:?}");
            }
        }
        match present.first() {
            Some(&f) if !flipped => assert_eq!(st.first_seq, f, "seed {seed}"),
            None if st.msgs == 0 && st.last_seq > 0 => {
                assert_eq!(st.first_seq, st.last_seq + 1, "seed {seed}")
            }
            _ => {}
        }
        // New epoch: what is there now is durable (recovery synced its own changes).
        self.maybe_synced = false;
        let last = st.last_seq;
        self.all.retain(|&q, _| q <= last);
        self.synced = live(s);
        self.since.clear();
        let l = self.limits.clone();
        let s = self.store.as_mut().unwrap();
        let r = s.set_limits(l).and_then(|_| s.sync());
        if self.io(r).is_some() {
            self.synced = live(self.store.as_ref().unwrap());
            self.synced_last = self.store.as_ref().unwrap().state().last_seq;
        }
    }

    /// A sync in its two halves with reads in between (what the server's stream actor
    /// does), the reads checked against what was stored.
    fn split_sync(&mut self) -> Result<()> {
        let Some(mut job) = self.s().begin_sync()? else {
            return Ok(());
        };
        let live: Vec<u64> = live(self.s()).into_iter().collect();
        for _ in 0..3 {
            if live.is_empty() {
                break;
            }
            let q = live[self.rng.below(live.len() as u64) as usize];
            if let Ok(m) = self.s().load(q) {
                if !self.flipped {
                    let got = (m.subject.to_vec(), m.hdr.to_vec(), m.data.to_vec(), m.ts);
                    assert_eq!(
                        self.all.get(&q),
                        Some(&got),
                        "seed {}: read of {q}",
                        self.seed
                    );
                }
            }
        }
        job.run();
        self.s().finish_sync(job)
    }

    fn crash(&mut self, stats: &mut Stats) {
        let now = self.store.as_ref().map(live).unwrap_or_default();
        if let Some(s) = self.store.take() {
            s.crash();
        }
        let flips = if self.rng.chance(8) {
            1 + self.rng.below(3) as usize
        } else {
            0
        };
        let rep = self.sim.crash(flips);
        self.trace(format_args!("CRASH flips {flips}"));
        self.dump();
        if rep.flipped > 0 {
            self.flipped = true;
            stats.flips += rep.flipped as u64;
        }
        if self.rng.chance(15) {
            self.lose_data(stats);
        }
        stats.crashes += 1;
        self.open(stats);
        let must: BTreeSet<u64> = self.synced.intersection(&now).copied().collect();
        let allowed: BTreeSet<u64> = self.synced.union(&self.since).copied().collect();
        self.verify(&must, &allowed, stats);
    }

    /// After a power failure, the disk also loses synced data: the tail of a segment, or
    /// a whole segment that is not the newest.
    fn lose_data(&mut self, stats: &mut Stats) {
        let segs: Vec<(PathBuf, usize)> = self
            .sim
            .dump()
            .into_iter()
            .filter(|(p, _)| p.extension().is_some_and(|e| e == "seg"))
            .map(|(p, d)| (p, d.len()))
            .collect();
        let head = crate::record::HEADS_LEN;
        // The newest segment with a head must stay: it is what says how far sequences went.
        let newest = segs.iter().rposition(|(_, len)| *len >= head).unwrap_or(0);
        if newest >= 1 && self.rng.chance(2) {
            let (p, _) = &segs[self.rng.below(newest as u64) as usize];
            self.trace(format_args!("LOSE {}", p.display()));
            self.sim.lose(p);
        } else {
            let (p, len) = &segs[self.rng.below(segs.len() as u64) as usize];
            if *len <= head {
                return;
            }
            let cut = head + self.rng.below((*len - head) as u64) as usize;
            self.trace(format_args!("CHOP {} to {cut}", p.display()));
            self.sim.chop(p, cut);
        }
        self.lossy = true;
        stats.data_losses += 1;
    }

    /// After an I/O failure the space comes back: the next sync rolls back to the last
    /// completed sync and reports it, and the store takes writes again.
    fn roll_back(&mut self, stats: &mut Stats) {
        let now = live(self.s());
        self.sim.heal();
        self.dump();
        let r = self.s().sync();
        self.trace(format_args!("HEAL, sync => {r:?}"));
        self.dump();
        if self.rolled_back {
            assert_eq!(r, Ok(()), "seed {}: sync after a rollback", self.seed);
        } else {
            assert!(
                matches!(r, Err(StoreError::Io(_))),
                "seed {}: a sync after a failure must report the rollback",
                self.seed
            );
        }
        self.rolled_back = false;
        stats.rollbacks += 1;
        self.failed = false;
        self.rep = RecoveryReport::default();
        // Nothing written since the last completed sync survives (no write that got an
        // error is there); everything synced and not removed since does, unless the
        // limits (re-applied to the rolled-back state) discard it.
        let must: BTreeSet<u64> = if self.limits == Limits::default() {
            self.synced.intersection(&now).copied().collect()
        } else {
            BTreeSet::new()
        };
        let allowed = if self.maybe_synced {
            self.synced.union(&self.since).copied().collect()
        } else {
            self.synced.clone()
        };
        self.verify(&must, &allowed, stats);
        assert!(self.s().store_msg(b"a", b"", b"after", 0).is_ok());
        let seq = self.s().state().last_seq;
        self.all
            .insert(seq, (b"a".to_vec(), vec![], b"after".to_vec(), 0));
        self.since.insert(seq);
    }

    fn clean_restart(&mut self, stats: &mut Stats) {
        let now = live(self.s());
        let before = (self.s().state(), self.s().deleted());
        let r = self.s().close();
        if self.io(r).is_none() {
            self.maybe_synced = true;
            return;
        }
        self.synced = now.clone();
        self.since.clear();
        self.synced_last = before.0.last_seq;
        drop(self.store.take());
        stats.clean_restarts += 1;
        self.trace(format_args!("CLEAN RESTART"));
        self.dump();
        self.open(stats);
        if !self.flipped {
            let after = (self.s().state(), self.s().deleted());
            assert_eq!(
                after, before,
                "seed {}: state across a clean restart",
                self.seed
            );
        }
        self.verify(&now, &now, stats);
    }

    /// A sync, then a compaction, with a power failure before it runs, after it wrote the
    /// new segment, or after it renamed it into place; or a failure while it writes.
    fn compact(&mut self, stats: &mut Stats) {
        let now = live(self.s());
        let r = self.s().sync();
        self.trace(format_args!("sync before compaction => {r:?}"));
        if self.io(r).is_none() {
            return;
        }
        self.synced = now;
        self.since.clear();
        self.synced_last = self.s().state().last_seq;
        let Some(job) = self.s().compact_begin() else {
            return;
        };
        stats.compactions += 1;
        let at = self.rng.below(6);
        self.trace(format_args!(
            "COMPACT segment {} (crash point {at})",
            job.segment()
        ));
        if at == 0 {
            stats.compaction_crashes += 1;
            return self.crash(stats);
        }
        if at == 4 {
            self.sim.fail_after(self.rng.below(8));
        }
        let done = job.run();
        if at == 1 {
            stats.compaction_crashes += 1;
            return self.crash(stats);
        }
        let r = self.s().compact_end(done);
        self.trace(format_args!("compacted => {r:?}"));
        self.dump();
        if at == 2 {
            stats.compaction_crashes += 1;
            return self.crash(stats);
        }
        // A failed compaction leaves the store as it was (the armed failure then hits the
        // next operation).
        if r.is_ok() {
            assert_eq!(
                live(self.s()),
                self.synced,
                "seed {}: compaction",
                self.seed
            );
        }
    }

    fn dump(&self) {
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            for (name, data) in self.sim.dump() {
                let mut o = 0;
                let mut recs = Vec::new();
                while o < data.len() {
                    match crate::record::parse(&data[o..]) {
                        crate::record::Parse::Ok(r) => {
                            let extra = match r.kind {
                                crate::record::Kind::Ledger => {
                                    format!("{:?}", crate::record::decode_ledger(r.data))
                                }
                                _ => String::new(),
                            };
                            recs.push(format!("{:?}{}@{o}{extra}", r.kind, r.seq));
                            o += r.len;
                        }
                        crate::record::Parse::Bad => {
                            let b = &data[o..];
                            let hint = if b.len() >= 24 {
                                format!(
                                    "(kind {} len {} seq {})",
                                    b[12],
                                    u32::from_le_bytes(b[4..8].try_into().unwrap()),
                                    u64::from_le_bytes(b[16..24].try_into().unwrap())
                                )
                            } else {
                                String::new()
                            };
                            recs.push(format!("BAD@{o}..{}{hint}", data.len()));
                            match crate::record::resync(&data, o + 1) {
                                Some(n) => {
                                    o = n;
                                    continue;
                                }
                                None => {
                                    let nz =
                                        data.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
                                    recs.push(format!("(nonzero to {nz})"));
                                    break;
                                }
                            }
                        }
                    }
                }
                eprintln!("   {}: {}", name.display(), recs.join(" "));
            }
        }
    }

    fn trace(&self, what: std::fmt::Arguments) {
        if std::env::var_os("KEEL_SIM_TRACE").is_some() {
            let st = self.store.as_ref().map(|s| s.state());
            eprintln!(
                "{what} -> {:?}",
                st.map(|s| (s.first_seq, s.last_seq, s.msgs))
            );
        }
    }

    fn step(&mut self, stats: &mut Stats) {
        stats.ops += 1;
        if self.failed {
            if self.rng.chance(2) {
                self.crash(stats);
            } else {
                self.roll_back(stats);
            }
            return;
        }
        let r = self.rng.below(100);
        match r {
            0..=49 => {
                let subj = SUBJECTS[self.rng.below(SUBJECTS.len() as u64) as usize].as_bytes();
                let big = self.rng.chance(40);
                let dlen = if big {
                    1500
                } else {
                    self.rng.below(200) as usize
                };
                let salt = self.rng.next();
                let hdr = if self.rng.chance(3) {
                    hdr_bytes(1 + self.rng.below(10) as usize, salt)
                } else {
                    vec![]
                };
                let data = payload(subj[0], dlen, salt);
                let ts = self.rng.below(1000) as i64;
                // Now and then at a given sequence past the next (a replica's store_at).
                let gap = if self.rng.chance(8) {
                    1 + self.rng.below(3)
                } else {
                    0
                };
                let seq = self.s().state().last_seq + 1 + gap;
                let content = (subj.to_vec(), hdr.clone(), data.clone(), ts);
                let r = if gap > 0 {
                    self.s().store_at(seq, subj, &hdr, &data, ts).map(|_| seq)
                } else {
                    self.s().store_msg(subj, &hdr, &data, ts)
                };
                self.trace(format_args!(
                    "store {} len {} => {r:?}",
                    String::from_utf8_lossy(subj),
                    data.len()
                ));
                match r {
                    Ok(got) => {
                        assert_eq!(got, seq, "seed {}", self.seed);
                        self.all.insert(seq, content);
                        self.since.insert(seq);
                    }
                    Err(StoreError::Io(_)) => {
                        // Maybe written, never acknowledged.
                        self.all.insert(seq, content);
                        self.since.insert(seq);
                        self.failed = true;
                    }
                    Err(_) => {}
                }
            }
            50..=61 => {
                let st = self.s().state();
                let lo = st.first_seq.saturating_sub(2);
                let seq = lo + self.rng.below(st.last_seq + 3 - lo);
                let erase = self.rng.chance(3);
                stats.erases += erase as u64;
                let r = self.s().remove(seq, erase);
                self.trace(format_args!("remove {seq} erase {erase} => {r:?}"));
                if erase && matches!(r, Err(StoreError::Io(_))) {
                    self.maybe_synced = true;
                }
                if erase && r == Ok(true) {
                    // An erase syncs (its tombstone goes first): everything so far is durable.
                    self.synced = live(self.s());
                    self.since.clear();
                    self.synced_last = self.s().state().last_seq;
                }
                self.io(r);
            }
            62..=64 => {
                let st = self.s().state();
                let filter = ["", "a", "a.*", "b.>", "*"][self.rng.below(5) as usize];
                let p = match self.rng.below(4) {
                    0 => Purge::default(),
                    1 => Purge {
                        filter: Some(filter.into()),
                        ..Default::default()
                    },
                    2 => Purge {
                        filter: Some(filter.into()),
                        keep: Some(self.rng.below(5)),
                        seq: None,
                    },
                    _ => Purge {
                        filter: Some(filter.into()),
                        seq: Some(st.first_seq + self.rng.below(st.msgs + 5)),
                        keep: None,
                    },
                };
                let r = self.s().purge(&p);
                self.trace(format_args!("purge {p:?} => {r:?}"));
                self.io(r);
            }
            65..=66 => {
                let now = self.rng.below(1500) as i64;
                let r = self.s().expire(now);
                self.trace(format_args!("expire {now} => {r:?}"));
                self.io(r);
            }
            67 => {
                let mut l = Limits::default();
                match self.rng.below(4) {
                    0 => l.max_msgs = 1 + self.rng.below(40) as i64,
                    1 => l.max_msgs_per_subject = 1 + self.rng.below(4) as i64,
                    2 => l.max_age = Duration::from_nanos(200 + self.rng.below(800)),
                    _ => {}
                }
                self.limits = l.clone();
                self.trace(format_args!("set_limits {l:?}"));
                let r = self.s().set_limits(l);
                self.io(r);
            }
            68..=84 => {
                let now = live(self.s());
                let r = if self.rng.chance(2) {
                    self.split_sync()
                } else {
                    self.s().sync()
                };
                self.trace(format_args!("sync => {r:?}"));
                if self.io(r).is_some() {
                    self.synced = now;
                    self.since.clear();
                    self.synced_last = self.s().state().last_seq;
                    stats.syncs_ok += 1;
                }
            }
            85..=90 => self.crash(stats),
            91..=93 => self.clean_restart(stats),
            94..=95 => self.compact(stats),
            _ => {
                stats.injected_failures += 1;
                let n = self.rng.below(25);
                self.trace(format_args!("fail after {n}"));
                self.sim.fail_after(n);
            }
        }
    }
}

fn run_case(seed: u64, stats: &mut Stats) {
    let mut rng = Rng(seed);
    let cfg = FileStoreConfig {
        segment_size: 300 + rng.below(3000),
        write_buffer: rng.below(700) as usize,
        ..Default::default()
    };
    let mut limits = Limits::default();
    if rng.chance(3) {
        limits.max_msgs = 5 + rng.below(50) as i64;
    }
    if rng.chance(4) {
        limits.max_msgs_per_subject = 1 + rng.below(3) as i64;
    }
    let mut c = Case {
        rng,
        sim: SimFs::new(seed),
        dir: Path::new("/stream").to_path_buf(),
        cfg,
        limits,
        store: None,
        all: HashMap::new(),
        synced: BTreeSet::new(),
        since: BTreeSet::new(),
        flipped: false,
        lossy: false,
        rep: RecoveryReport::default(),
        maybe_synced: false,
        failed: false,
        rolled_back: false,
        seed,
        synced_last: 0,
    };
    c.open(stats);
    let ops = 60 + c.rng.below(200);
    for _ in 0..ops {
        c.step(stats);
    }
    // Always end with a power failure.
    c.crash(stats);
    stats.cases += 1;
}

#[test]
fn acknowledged_messages_survive_power_failures() {
    let seeds = super::sim::seeds(2000);
    let cases = seeds.end - seeds.start;
    let mut stats = Stats::default();
    for seed in seeds {
        run_case(seed, &mut stats);
    }
    eprintln!("{stats:?}");
    // The workload must actually exercise the interesting paths.
    assert!(stats.crashes > cases && stats.clean_restarts > 0 && stats.syncs_ok > cases);
    assert!(stats.torn > 0 && stats.used_index > 0 && stats.flips > 0);
    assert!(stats.rollbacks > 0 && stats.data_losses > 0 && stats.reported_losses > 0);
    assert!(stats.compactions > 0 && stats.compaction_crashes > 0);
}

/// Seeds that once failed, run on their own whatever the default seed range is. 829: a
/// record of a segment with `store_at` gaps was damaged while its index blocks were too,
/// and the rebuild dropped it unreported. 7880: recovery did not see the gaps of a sealed
/// sparse segment, so an unsynced gap was never recorded and a later recovery called it
/// lost. 8948: a compaction dropped the tombstone of a message whose erase had been torn
/// in an already compacted segment, so the torn bytes later read as a loss. 9935: a
/// rebuilt index file counted the bytes of an entry it also listed as never counting.
/// 32859: a failed sync that rolled back at once (it says so) has nothing left for the
/// next sync to report. 48804: a torn erase was taken to hide the sequences after it, so
/// an unsynced gap there read as lost. (Index files have a new field since, which moves
/// where the simulator's damage lands; deterministic tests: in file_tests
/// `lost_record_of_a_sparse_segment_under_a_damaged_index_is_reported`,
/// `unsynced_gap_of_a_sealed_sparse_segment_is_never_reported_lost`,
/// `torn_erase_hides_no_unsynced_gap`, and in segtable
/// `summary_never_counts_an_entry_it_lists_as_erased`.)
#[test]
fn seeds_that_failed_once() {
    let mut stats = Stats::default();
    for seed in [829, 7880, 8948, 9935, 32859, 48804] {
        run_case(seed, &mut stats);
    }
}

/// Sync-per-message on the simulator really fsyncs once per sync, and none in store_msg.
#[test]
fn store_msg_never_fsyncs() {
    let sim = SimFs::new(1);
    let (mut s, _) = FileStore::open_fs(
        Arc::new(sim.clone()),
        Path::new("/s"),
        Limits::default(),
        FileStoreConfig::default(),
    )
    .unwrap();
    // The first sync after the segment became durable also writes the sequence
    // reservation naming it (again only per segment or per `RESERVE_AHEAD` messages).
    s.store_msg(b"a", b"", b"first", 0).unwrap();
    let before = sim.syncs();
    s.sync().unwrap();
    assert_eq!(sim.syncs() - before, 2);
    let before = sim.syncs();
    for i in 0..1000 {
        s.store_msg(b"a", b"", &payload(1, 100, i), 0).unwrap();
    }
    assert_eq!(sim.syncs(), before);
    s.sync().unwrap();
    assert!(sim.syncs() - before <= 1);
    assert!(sim.names().len() <= 3);
}

/// A kill (the page cache kept) right after the store rolled to a new segment leaves that
/// segment's directory entry unsynced; what is acknowledged into it after the restart must
/// survive a power failure (the first sync after opening makes the directory durable).
/// Before, 18 of these 40 seeds lost the acknowledged message.
#[test]
fn a_kill_then_a_power_loss_keeps_what_was_acknowledged_in_a_new_segment() {
    for seed in 0..40 {
        let sim = SimFs::new(seed);
        let cfg = FileStoreConfig {
            segment_size: 4096,
            ..FileStoreConfig::default()
        };
        let open = || super::sim::open(&sim, &cfg);
        let (mut s, _) = open();
        while s.segment_count() < 3 {
            s.store_msg(b"a", b"", &[7u8; 100], 0).unwrap();
            s.sync().unwrap();
        }
        let c = s.segment_count();
        while s.segment_count() == c {
            s.store_msg(b"a", b"", &[7u8; 100], 0).unwrap();
        }
        s.crash(); // A kill: the new segment's directory entry is in the cache only.
        let (mut s, rep) = open();
        assert_eq!(rep.segments_missing, None, "seed {seed}");
        let q = s.store_msg(b"a", b"", b"acked", 0).unwrap();
        s.sync().unwrap();
        s.crash();
        sim.crash(0); // A power failure.
        let (s, rep) = open();
        assert_eq!(rep.segments_missing, None, "seed {seed}");
        assert!(rep.lost.is_empty(), "seed {seed}: {rep:?}");
        assert_eq!(&s.load(q).unwrap().data[..], b"acked", "seed {seed}");
    }
}
