//! A deliberately naive model of the reference semantics (a BTreeMap and linear scans), and
//! a random operation generator. Property tests run the same operations against the model
//! and the real stores and compare every answer.

use crate::*;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, Clone)]
pub(crate) struct MMsg {
    pub subject: String,
    pub hdr: Vec<u8>,
    pub data: Vec<u8>,
    pub ts: i64,
}

/// `size` is the store's accounting formula (file or memory).
#[derive(Clone)]
pub(crate) struct Model {
    pub msgs: BTreeMap<u64, MMsg>,
    pub first: u64,
    pub first_ts: i64,
    pub last: u64,
    pub last_ts: i64,
    pub bytes: u64,
    pub limits: Limits,
    pub size: fn(usize, usize, usize) -> u64,
}

impl Model {
    pub fn new(limits: Limits, size: fn(usize, usize, usize) -> u64) -> Self {
        Model {
            msgs: BTreeMap::new(),
            first: 0,
            first_ts: 0,
            last: 0,
            last_ts: 0,
            bytes: 0,
            limits,
            size,
        }
    }

    fn sz(&self, m: &MMsg) -> u64 {
        (self.size)(m.subject.len(), m.hdr.len(), m.data.len())
    }

    fn count_subj(&self, s: &str) -> u64 {
        self.msgs.values().filter(|m| m.subject == s).count() as u64
    }

    pub fn remove(&mut self, seq: u64) -> bool {
        let Some(m) = self.msgs.remove(&seq) else {
            return false;
        };
        self.bytes -= self.sz(&m);
        self.fix_first();
        true
    }

    fn fix_first(&mut self) {
        match self.msgs.iter().next() {
            Some((&s, m)) => {
                self.first = s;
                self.first_ts = m.ts;
            }
            None => {
                self.first = self.last + 1;
                self.first_ts = 0;
            }
        }
    }

    pub fn store(&mut self, subject: &str, hdr: &[u8], data: &[u8], ts: i64) -> Result<u64> {
        let l = self.limits.clone();
        if l.max_msg_size > 0 && (hdr.len() + data.len()) as i64 > l.max_msg_size {
            return Err(StoreError::MsgTooLarge);
        }
        let m = MMsg {
            subject: subject.into(),
            hdr: hdr.into(),
            data: data.into(),
            ts,
        };
        let size = self.sz(&m);
        if l.discard == Discard::New {
            let asl = l.max_msgs_per_subject > 0
                && self.count_subj(subject) >= l.max_msgs_per_subject as u64;
            if asl && l.discard_new_per_subject {
                return Err(StoreError::MaxMsgsPerSubject);
            }
            if l.max_msgs > 0 && self.msgs.len() as u64 >= l.max_msgs as u64 && !asl {
                return Err(StoreError::MaxMsgs);
            }
            if l.max_bytes > 0 && self.bytes + size > l.max_bytes as u64 {
                if !asl {
                    return Err(StoreError::MaxBytes);
                }
                let f = self.msgs.values().find(|m| m.subject == subject).unwrap();
                if self.sz(f) < size {
                    return Err(StoreError::MaxBytes);
                }
            }
        }
        let seq = self.last + 1;
        if self.msgs.is_empty() {
            self.first = seq;
            self.first_ts = ts;
        }
        self.msgs.insert(seq, m);
        self.bytes += size;
        self.last = seq;
        self.last_ts = ts;
        if l.max_msgs_per_subject > 0 {
            while self.count_subj(subject) > l.max_msgs_per_subject as u64 {
                let f = *self
                    .msgs
                    .iter()
                    .find(|(_, m)| m.subject == subject)
                    .unwrap()
                    .0;
                self.remove(f);
            }
        }
        self.enforce();
        Ok(seq)
    }

    fn enforce(&mut self) {
        let l = self.limits.clone();
        if l.discard != Discard::Old {
            return;
        }
        while (l.max_msgs > 0 && self.msgs.len() as u64 > l.max_msgs as u64)
            || (l.max_bytes > 0 && self.bytes > l.max_bytes as u64)
        {
            let f = *self.msgs.keys().next().unwrap();
            self.remove(f);
        }
    }

    fn reset(&mut self, next: u64) -> u64 {
        let n = self.msgs.len() as u64;
        self.msgs.clear();
        self.bytes = 0;
        self.first = next;
        self.first_ts = 0;
        self.last = next - 1;
        n
    }

    fn skip_to(&mut self, next: u64) {
        if next <= self.last + 1 {
            return;
        }
        if self.msgs.is_empty() {
            self.reset(next);
        } else {
            self.last = next - 1;
        }
    }

    pub fn store_at(
        &mut self,
        seq: u64,
        subject: &str,
        hdr: &[u8],
        data: &[u8],
        ts: i64,
    ) -> Result<()> {
        if seq <= self.last {
            return Err(StoreError::Sequence {
                seq,
                last: self.last,
            });
        }
        self.skip_to(seq);
        self.store(subject, hdr, data, ts).map(|_| ())
    }

    pub fn truncate(&mut self, after: u64) -> u64 {
        if after >= self.last {
            return 0;
        }
        let gone: Vec<u64> = self.msgs.range(after + 1..).map(|(&q, _)| q).collect();
        for &q in &gone {
            self.remove(q);
        }
        self.last = after;
        self.last_ts = self.msgs.values().next_back().map_or(0, |m| m.ts);
        if self.msgs.is_empty() {
            self.first = after + 1;
            self.first_ts = 0;
        }
        gone.len() as u64
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut deleted: Vec<(u64, u64)> = Vec::new();
        for q in self.deleted() {
            match deleted.last_mut() {
                Some((_, b)) if *b + 1 == q => *b = q,
                _ => deleted.push((q, q)),
            }
        }
        Snapshot {
            first_seq: self.first,
            last_seq: self.last,
            last_ts: self.last_ts,
            deleted,
        }
    }

    pub fn purge(&mut self, p: &Purge) -> u64 {
        let seq = p.seq.unwrap_or(0);
        let keep = p.keep.unwrap_or(0);
        if seq == 1 {
            return 0;
        }
        let filter = p.filter.clone().unwrap_or_default();
        if is_all(&filter) {
            if keep == 0 && seq == 0 {
                let next = self.last + 1;
                return self.reset(next);
            }
            if seq > 1 {
                if self.first > seq {
                    return 0;
                }
                if seq <= self.last {
                    let v: Vec<u64> = self.msgs.range(..seq).map(|(&s, _)| s).collect();
                    for &s in &v {
                        self.remove(s);
                    }
                    return v.len() as u64;
                }
                return self.reset(seq);
            }
        }
        let matching: Vec<u64> = self
            .msgs
            .iter()
            .filter(|(_, m)| filter_matches(&filter, m.subject.as_bytes()))
            .map(|(&s, _)| s)
            .collect();
        if matching.is_empty() {
            return 0;
        }
        let mut max = usize::MAX;
        if keep > 0 {
            if keep >= matching.len() as u64 {
                return 0;
            }
            max = matching.len() - keep as usize;
        }
        let v: Vec<u64> = matching
            .into_iter()
            .filter(|&s| seq == 0 || s < seq)
            .take(max)
            .collect();
        for &s in &v {
            self.remove(s);
        }
        v.len() as u64
    }

    pub fn expire(&mut self, now: i64) -> (u64, Option<i64>) {
        let age = self.limits.max_age.as_nanos() as i64;
        if age == 0 {
            return (0, None);
        }
        let mut n = 0;
        while let Some((&s, m)) = self.msgs.iter().next() {
            if m.ts > now - age {
                break;
            }
            self.remove(s);
            n += 1;
        }
        (n, self.msgs.values().next().map(|m| m.ts + age))
    }

    pub fn set_limits(&mut self, l: Limits) {
        let old = self.limits.max_msgs_per_subject;
        self.limits = l.clone();
        self.enforce();
        let per = l.max_msgs_per_subject;
        if per > 0 && (old <= 0 || per < old) {
            let subjects: Vec<String> = self.subjects(">").into_keys().collect();
            for s in subjects {
                while self.count_subj(&s) > per as u64 {
                    let f = *self.msgs.iter().find(|(_, m)| m.subject == s).unwrap().0;
                    self.remove(f);
                }
            }
        }
    }

    pub fn state(&self) -> State {
        let subjects = self.subjects(">").len() as u64;
        State {
            msgs: self.msgs.len() as u64,
            bytes: self.bytes,
            first_seq: self.first,
            first_ts: self.first_ts,
            last_seq: self.last,
            last_ts: self.last_ts,
            num_subjects: subjects,
            num_deleted: if self.msgs.is_empty() {
                0
            } else {
                self.last - self.first + 1 - self.msgs.len() as u64
            },
            lost: None,
        }
    }

    pub fn deleted(&self) -> Vec<u64> {
        if self.msgs.is_empty() {
            return vec![];
        }
        (self.first..=self.last)
            .filter(|s| !self.msgs.contains_key(s))
            .collect()
    }

    pub fn subjects(&self, filter: &str) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for m in self.msgs.values() {
            if filter_matches(filter, m.subject.as_bytes()) {
                *out.entry(m.subject.clone()).or_insert(0) += 1;
            }
        }
        out
    }

    pub fn load_next(&self, start: u64, filter: &str) -> Option<u64> {
        self.msgs
            .range(start..)
            .find(|(_, m)| filter_matches(filter, m.subject.as_bytes()))
            .map(|(&s, _)| s)
    }

    pub fn load_last(&self, filter: &str) -> Option<u64> {
        self.msgs
            .iter()
            .rev()
            .find(|(_, m)| filter_matches(filter, m.subject.as_bytes()))
            .map(|(&s, _)| s)
    }

    pub fn num_pending(&self, start: u64, filter: &str, lps: bool) -> u64 {
        if lps {
            let mut last: BTreeMap<&str, u64> = BTreeMap::new();
            for (&s, m) in &self.msgs {
                if filter_matches(filter, m.subject.as_bytes()) {
                    last.insert(&m.subject, s);
                }
            }
            return last.values().filter(|&&s| s >= start).count() as u64;
        }
        self.msgs
            .range(start..)
            .filter(|(_, m)| filter_matches(filter, m.subject.as_bytes()))
            .count() as u64
    }
}

/// Proptest case count: `PROPTEST_CASES` when set (for long runs), else `default`.
pub(crate) fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One step of a random workload.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Store {
        subj: usize,
        hdr: usize,
        data: usize,
        ts: i64,
    },
    /// Store at `gap` past the next sequence (0: the next one).
    StoreAt {
        gap: u64,
        subj: usize,
        data: usize,
        ts: i64,
    },
    /// Truncate `back` sequences off the end.
    Truncate {
        back: u64,
    },
    Remove {
        seq: u64,
        erase: bool,
    },
    Purge(Purge),
    Expire(i64),
    SetLimits(Limits),
    Sync,
    /// Close and reopen (file store only; a no-op elsewhere).
    Reopen,
    /// Writes fail (a full disk), then space comes back and the next sync rolls back to
    /// the last completed sync (file store on the simulator only; a no-op elsewhere).
    Rollback,
    /// Compacts every segment worth it (the file store; syncs first; a no-op elsewhere).
    Compact,
}

pub(crate) const SUBJECTS: &[&str] = &["a", "b", "a.x", "a.y", "b.x", "c.d.e", "foo.bar.baz"];
pub(crate) const FILTERS: &[&str] = &["", ">", "a", "a.*", "*.x", "b.>", "c.*.e", "*", "zz"];

/// Deterministic payload for a (subject, length, seq) so content checks need no storage.
pub(crate) fn payload(tag: u8, len: usize, salt: u64) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(31)
                .wrapping_add(salt.wrapping_mul(7).wrapping_add(tag as u64)) as u8
        })
        .collect()
}

pub(crate) fn hdr_bytes(len: usize, salt: u64) -> Vec<u8> {
    if len == 0 {
        return vec![];
    }
    let mut h = b"NATS/1.0\r\nK: ".to_vec();
    h.extend(payload(b'h', len, salt).iter().map(|b| b'a' + b % 26));
    h.extend_from_slice(b"\r\n\r\n");
    h
}

pub(crate) fn arb_limits() -> impl Strategy<Value = Limits> {
    (
        prop_oneof![Just(-1i64), 1..20i64],
        prop_oneof![Just(-1i64), 200..2000i64],
        prop_oneof![Just(0u64), 5..50u64],
        prop_oneof![Just(-1i64), 1..4i64],
        prop_oneof![Just(-1i64), 30..200i64],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(mm, mb, age, per, mms, dn, dnp)| Limits {
            max_msgs: mm,
            max_bytes: mb,
            max_age: Duration::from_nanos(age),
            max_msgs_per_subject: per,
            max_msg_size: mms,
            discard: if dn { Discard::New } else { Discard::Old },
            discard_new_per_subject: dnp,
        })
}

pub(crate) fn arb_purge() -> impl Strategy<Value = Purge> {
    (
        prop::option::of(prop::sample::select(FILTERS)),
        prop::option::of(0..60u64),
        prop::option::of(0..6u64),
    )
        .prop_map(|(f, seq, keep)| Purge {
            filter: f.map(String::from),
            // `seq` and `keep` are exclusive in the API.
            keep: if seq.is_some() { None } else { keep },
            seq,
        })
}

/// `with_bytes_limit` false keeps max_bytes unlimited, for comparing stores whose byte
/// accounting differs (memory vs file).
pub(crate) fn arb_op(with_bytes_limit: bool) -> impl Strategy<Value = Op> {
    let limits = arb_limits().prop_map(move |mut l| {
        if !with_bytes_limit {
            l.max_bytes = -1;
        }
        l
    });
    prop_oneof![
        12 => (0..SUBJECTS.len(), prop_oneof![Just(0usize), 1..20usize], 0..150usize, 0..100i64)
            .prop_map(|(subj, hdr, data, ts)| Op::Store { subj, hdr, data, ts }),
        3 => (0..60u64, any::<bool>()).prop_map(|(seq, erase)| Op::Remove { seq, erase }),
        2 => (0..4u64, 0..SUBJECTS.len(), 0..100usize, 0..100i64)
            .prop_map(|(gap, subj, data, ts)| Op::StoreAt { gap, subj, data, ts }),
        1 => (0..6u64).prop_map(|back| Op::Truncate { back }),
        1 => arb_purge().prop_map(Op::Purge),
        1 => (0..150i64).prop_map(Op::Expire),
        1 => limits.prop_map(Op::SetLimits),
        2 => Just(Op::Sync),
        1 => Just(Op::Reopen),
        1 => Just(Op::Rollback),
        1 => Just(Op::Compact),
    ]
}

/// Compares every query answer of `s` with the model.
pub(crate) fn check_same(s: &dyn Store, m: &Model, compare_bytes: bool) {
    let mut st = s.state();
    let mut ms = m.state();
    st.lost = None;
    if !compare_bytes {
        st.bytes = 0;
        ms.bytes = 0;
    }
    assert_eq!(st, ms, "state");
    assert_eq!(s.deleted(), m.deleted(), "deleted");
    assert_eq!(s.snapshot(), m.snapshot(), "snapshot");
    for &f in FILTERS {
        assert_eq!(s.subjects(f), m.subjects(f), "subjects {f}");
        assert_eq!(
            s.load_last(f).ok().map(|x| x.seq),
            m.load_last(f),
            "load_last {f}"
        );
        for start in [
            0,
            1,
            m.first,
            m.first + 1,
            (m.first + m.last) / 2,
            m.last,
            m.last + 1,
        ] {
            assert_eq!(
                s.load_next(start, f).ok().map(|x| x.seq),
                m.load_next(start, f),
                "load_next {start} {f}"
            );
            for lps in [false, true] {
                assert_eq!(
                    s.num_pending(start, f, lps),
                    m.num_pending(start, f, lps),
                    "num_pending {start} {f} {lps}"
                );
            }
        }
    }
    for subj in SUBJECTS {
        let want = m
            .msgs
            .iter()
            .rev()
            .find(|(_, x)| x.subject == *subj)
            .map_or(0, |(&q, _)| q);
        assert_eq!(s.last_seq_for_subject(subj), want, "last_seq_for_subject");
    }
    for (&seq, mm) in &m.msgs {
        let got = s.load(seq).unwrap_or_else(|e| panic!("load {seq}: {e}"));
        assert_eq!(got.subject, mm.subject.as_bytes(), "subject of {seq}");
        assert_eq!(got.hdr, mm.hdr, "hdr of {seq}");
        assert_eq!(got.data, mm.data, "data of {seq}");
        assert_eq!(got.ts, mm.ts, "ts of {seq}");
    }
}

/// Applies one op to both; returns false for Reopen/Sync which the caller handles.
pub(crate) fn apply(s: &mut dyn Store, m: &mut Model, op: &Op, step: u64) {
    match op {
        Op::Store {
            subj,
            hdr,
            data,
            ts,
        } => {
            let h = hdr_bytes(*hdr, step);
            let d = payload(*subj as u8, *data, step);
            let subject = SUBJECTS[*subj];
            let a = s.store_msg(subject.as_bytes(), &h, &d, *ts);
            let b = m.store(subject, &h, &d, *ts);
            assert_eq!(a, b, "store_msg");
        }
        Op::StoreAt {
            gap,
            subj,
            data,
            ts,
        } => {
            let d = payload(*subj as u8, *data, step);
            let subject = SUBJECTS[*subj];
            let seq = m.last + 1 + gap;
            let a = s.store_at(seq, subject.as_bytes(), b"", &d, *ts);
            let b = m.store_at(seq, subject, b"", &d, *ts);
            assert_eq!(a, b, "store_at {seq}");
            // Never at or below the last sequence.
            let last = m.last;
            assert_eq!(
                s.store_at(last, subject.as_bytes(), b"", &d, *ts),
                Err(StoreError::Sequence { seq: last, last })
            );
        }
        Op::Truncate { back } => {
            let after = m.last.saturating_sub(*back);
            match s.truncate(after) {
                // The file store cannot lower its last sequence yet.
                Err(StoreError::Unsupported(_)) => {}
                r => assert_eq!(r.unwrap(), m.truncate(after), "truncate {after}"),
            }
        }
        Op::Remove { seq, erase } => {
            assert_eq!(s.remove(*seq, *erase).unwrap(), m.remove(*seq), "remove");
        }
        Op::Purge(p) => assert_eq!(s.purge(p).unwrap(), m.purge(p), "purge {p:?}"),
        Op::Expire(now) => assert_eq!(s.expire(*now).unwrap(), m.expire(*now), "expire"),
        Op::SetLimits(l) => {
            s.set_limits(l.clone()).unwrap();
            m.set_limits(l.clone());
        }
        Op::Sync => s.sync().unwrap(),
        Op::Compact => {
            while let Some(job) = s.compact_begin() {
                s.compact_end(job.run()).unwrap();
            }
        }
        Op::Reopen | Op::Rollback => {}
    }
}
