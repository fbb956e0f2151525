//! The memory store: messages live in the shared slot table (see `core`), nothing touches
//! disk, `close` is a no-op.
//!
//! **Rollback.** A replica of a replicated stream sets an applied marker; from then on the
//! store can go back to its last `sync` (`discard_unsynced`), as the file store does: it
//! keeps, since that sync, an undo journal (each sequence it inserted, each message it
//! removed, payload and all) and the scalars it had. Rolling back replays the journal
//! backwards. The journal holds removed payloads only until the next sync (a replica
//! syncs every 200 ms), so it costs no copy and little memory.

use crate::index::{Core, Removed, SlotTable, Table};
use crate::{mem_msg_size, Limits, Purge, Result, Snapshot, State, Store, StoreError, StoredMsg};
use bytes::Bytes;
use std::collections::BTreeMap;

/// Subject, headers and payload in one allocation.
#[derive(Default, Clone)]
pub(crate) struct MemMsg {
    buf: Bytes,
    subj: u32,
    hdr: u32,
}

/// One step since the last sync, undone by a rollback.
enum Undo {
    Inserted(u64),
    Removed(Removed<MemMsg>),
}

/// The store as it was at the last sync, and the journal back to it.
struct Checkpoint {
    first_seq: u64,
    first_ts: i64,
    last_seq: u64,
    last_ts: i64,
    limits: Limits,
    age_exempt: std::collections::BTreeSet<u64>,
    applied: Vec<u8>,
    journal: Vec<Undo>,
}

/// Stream storage in memory.
pub struct MemStore {
    core: Core<SlotTable<MemMsg>>,
    applied: Vec<u8>,
    /// Kept once an applied marker is set (a replica's store): what a rollback needs.
    checkpoint: Option<Checkpoint>,
}

impl MemStore {
    pub fn new(limits: Limits) -> Self {
        MemStore {
            core: Core::new(limits, SlotTable::new()),
            applied: Vec::new(),
            checkpoint: None,
        }
    }

    fn checkpoint_now(&mut self) {
        let c = &self.core;
        self.checkpoint = Some(Checkpoint {
            first_seq: c.first_seq,
            first_ts: c.first_ts,
            last_seq: c.last_seq,
            last_ts: c.last_ts,
            limits: c.limits.clone(),
            age_exempt: c.age_exempt.clone(),
            applied: self.applied.clone(),
            journal: Vec::new(),
        });
        self.core.record_resets = true;
    }

    fn msg(&self, seq: u64) -> Result<StoredMsg> {
        let s = self.core.slots.slot(seq).ok_or(StoreError::NotFound)?;
        let m = &s.p;
        let (sl, hl) = (m.subj as usize, m.hdr as usize);
        Ok(StoredMsg {
            seq,
            subject: m.buf.slice(..sl),
            hdr: m.buf.slice(sl..sl + hl),
            data: m.buf.slice(sl + hl..),
            ts: self.core.slots.get(seq).map_or(0, |x| x.ts),
        })
    }

    /// After a core operation: its removals (and `inserted`, which came first) go to the
    /// journal when one is kept, else they are dropped.
    fn settle_with(&mut self, inserted: Option<u64>) {
        self.core.reset = false;
        match &mut self.checkpoint {
            Some(cp) => {
                if let Some(seq) = inserted {
                    cp.journal.push(Undo::Inserted(seq));
                }
                cp.journal
                    .extend(self.core.removed.drain(..).map(Undo::Removed));
            }
            None => self.core.removed.clear(),
        }
    }

    fn settle(&mut self) {
        self.settle_with(None);
    }
}

impl Store for MemStore {
    fn store_msg(&mut self, subject: &[u8], hdr: &[u8], data: &[u8], ts: i64) -> Result<u64> {
        let size = mem_msg_size(subject.len(), hdr.len(), data.len());
        self.core.check(subject, hdr.len(), data.len(), size)?;
        let mut buf = Vec::with_capacity(subject.len() + hdr.len() + data.len());
        buf.extend_from_slice(subject);
        buf.extend_from_slice(hdr);
        buf.extend_from_slice(data);
        let p = MemMsg {
            buf: Bytes::from(buf),
            subj: subject.len() as u32,
            hdr: hdr.len() as u32,
        };
        let seq = self.core.append(subject, ts, size, !hdr.is_empty(), p);
        self.settle_with(Some(seq));
        Ok(seq)
    }

    fn store_at(
        &mut self,
        seq: u64,
        subject: &[u8],
        hdr: &[u8],
        data: &[u8],
        ts: i64,
    ) -> Result<()> {
        let last = self.core.last_seq;
        if seq <= last {
            return Err(StoreError::Sequence { seq, last });
        }
        self.core.skip_to(seq);
        self.settle();
        self.store_msg(subject, hdr, data, ts).map(|_| ())
    }

    fn truncate(&mut self, after: u64) -> Result<u64> {
        let n = self.core.truncate(after);
        self.settle();
        Ok(n)
    }

    fn snapshot(&self) -> Snapshot {
        let c = &self.core;
        Snapshot {
            first_seq: c.first_seq,
            last_seq: c.last_seq,
            last_ts: c.last_ts,
            deleted: c.deleted_ranges(),
        }
    }

    /// Nothing to write; a replica's store takes a new checkpoint (see the module's doc).
    fn sync(&mut self) -> Result<()> {
        if self.checkpoint.is_some() {
            self.checkpoint_now();
        }
        Ok(())
    }

    /// The first marker starts the checkpoint, at the state before it.
    fn set_applied(&mut self, marker: &[u8]) -> Result<()> {
        crate::check_applied(marker)?;
        if self.checkpoint.is_none() {
            self.checkpoint_now();
        }
        self.applied = marker.to_vec();
        Ok(())
    }

    fn applied(&self) -> Vec<u8> {
        self.applied.clone()
    }

    /// Back to the last sync: the journal replayed backwards, then the scalars of then.
    /// Unsupported before a marker was ever set (no journal is kept).
    fn discard_unsynced(&mut self) -> Result<()> {
        let Some(mut cp) = self.checkpoint.take() else {
            return Err(StoreError::Unsupported(
                "the memory store keeps no synced state to roll back to",
            ));
        };
        while let Some(u) = cp.journal.pop() {
            match u {
                Undo::Inserted(seq) => {
                    self.core.remove(seq);
                }
                Undo::Removed(r) => {
                    let m = r.meta;
                    self.core
                        .insert(r.seq, &r.subject, m.ts, m.size, m.hdr, r.p);
                }
            }
            self.core.removed.clear();
        }
        let c = &mut self.core;
        c.reset = false;
        c.first_seq = cp.first_seq;
        c.first_ts = cp.first_ts;
        c.last_seq = cp.last_seq;
        c.last_ts = cp.last_ts;
        c.limits = cp.limits;
        c.age_exempt = cp.age_exempt;
        self.applied = cp.applied;
        self.checkpoint_now();
        Ok(())
    }

    fn load(&self, seq: u64) -> Result<StoredMsg> {
        self.msg(seq)
    }

    fn load_next(&self, start: u64, filter: &str) -> Result<StoredMsg> {
        let seq = self
            .core
            .find_next(start, filter)
            .ok_or(StoreError::NotFound)?;
        self.msg(seq)
    }

    fn load_last(&self, filter: &str) -> Result<StoredMsg> {
        let seq = self.core.find_last(filter).ok_or(StoreError::NotFound)?;
        self.msg(seq)
    }

    fn last_seq_for_subject(&self, subject: &str) -> u64 {
        self.core.last_seq_for_subject(subject)
    }

    fn peek(&self, seq: u64) -> Option<(i64, bool)> {
        self.core.slots.get(seq).map(|m| (m.ts, m.hdr))
    }

    fn remove(&mut self, seq: u64, _erase: bool) -> Result<bool> {
        // Dropping the Bytes is the erase: nothing else holds the payload except readers
        // that already loaded it.
        let r = self.core.remove(seq);
        self.settle();
        Ok(r)
    }

    fn purge(&mut self, opts: &Purge) -> Result<u64> {
        let n = self.core.purge(opts);
        self.settle();
        Ok(n)
    }

    fn expire(&mut self, now: i64) -> Result<(u64, Option<i64>)> {
        let r = self.core.expire(now);
        self.settle();
        Ok(r)
    }

    fn exempt_from_max_age(&mut self, seq: u64) {
        self.core.age_exempt.insert(seq);
    }

    fn skip_to(&mut self, next: u64) -> Result<()> {
        self.core.skip_to(next);
        self.settle();
        Ok(())
    }

    fn set_limits(&mut self, limits: Limits) -> Result<()> {
        self.core.set_limits(limits);
        self.settle();
        Ok(())
    }

    fn last_seq(&self) -> u64 {
        self.core.last_seq
    }

    fn state(&self) -> State {
        self.core.state()
    }

    fn deleted(&self) -> Vec<u64> {
        self.core.deleted()
    }

    fn subjects(&self, filter: &str) -> BTreeMap<String, u64> {
        self.core.subjects_map(filter)
    }

    fn num_pending(&self, start: u64, filter: &str, last_per_subject: bool) -> u64 {
        self.core.num_pending(start, filter, last_per_subject)
    }

    fn close(&mut self) -> Result<()> {
        Ok(())
    }

    fn destroy(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod rollback_tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Store(u8, u8),
        StoreAt(u8, u8),
        Remove(u8),
        PurgeAll,
        PurgeSubject(u8),
        PurgeBelow(u8),
        Truncate(u8),
        SkipTo(u8),
        Limits(u8),
        Exempt(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u8..4, any::<u8>()).prop_map(|(s, d)| Op::Store(s, d)),
            1 => (0u8..4, 0u8..8).prop_map(|(s, d)| Op::StoreAt(s, d)),
            2 => any::<u8>().prop_map(Op::Remove),
            1 => Just(Op::PurgeAll),
            1 => (0u8..4).prop_map(Op::PurgeSubject),
            1 => any::<u8>().prop_map(Op::PurgeBelow),
            1 => any::<u8>().prop_map(Op::Truncate),
            1 => (0u8..8).prop_map(Op::SkipTo),
            1 => (0u8..6).prop_map(Op::Limits),
            1 => any::<u8>().prop_map(Op::Exempt),
        ]
    }

    fn run(st: &mut MemStore, op: &Op, ts: &mut i64) {
        *ts += 1;
        let last = st.last_seq();
        let pick = |x: u8| if last == 0 { 1 } else { 1 + x as u64 % last };
        let subj = |s: u8| format!("s.{s}");
        match op {
            Op::Store(s, d) => {
                let _ = st.store_msg(subj(*s).as_bytes(), b"", &[*d; 3], *ts);
            }
            Op::StoreAt(s, d) => {
                let _ = st.store_at(last + 1 + *d as u64, subj(*s).as_bytes(), b"h", b"x", *ts);
            }
            Op::Remove(x) => {
                let _ = st.remove(pick(*x), false);
            }
            Op::PurgeAll => {
                let _ = st.purge(&Purge::default());
            }
            Op::PurgeSubject(s) => {
                let _ = st.purge(&Purge {
                    filter: Some(subj(*s)),
                    ..Default::default()
                });
            }
            Op::PurgeBelow(x) => {
                let _ = st.purge(&Purge {
                    seq: Some(pick(*x)),
                    ..Default::default()
                });
            }
            Op::Truncate(x) => {
                let _ = st.truncate(pick(*x).saturating_sub(1));
            }
            Op::SkipTo(d) => {
                let _ = st.skip_to(last + 1 + *d as u64);
            }
            Op::Limits(n) => {
                let _ = st.set_limits(Limits {
                    max_msgs: if *n == 0 { -1 } else { *n as i64 * 3 },
                    max_msgs_per_subject: if *n % 2 == 0 { -1 } else { *n as i64 },
                    ..Default::default()
                });
            }
            Op::Exempt(x) => st.exempt_from_max_age(pick(*x)),
        }
    }

    /// Everything a reader can see.
    fn dump(st: &MemStore) -> String {
        let s = st.state();
        let mut out = format!(
            "{:?} {:?} {:?} {:?} {:?} {:?}\n",
            (
                s.msgs,
                s.bytes,
                s.first_seq,
                s.first_ts,
                s.last_seq,
                s.last_ts
            ),
            (s.num_subjects, s.num_deleted),
            st.deleted(),
            st.subjects(">"),
            st.core.age_exempt,
            st.applied(),
        );
        for seq in 0..=st.last_seq() + 1 {
            if let Ok(m) = st.load(seq) {
                out += &format!("{seq} {:?} {:?} {:?} {}\n", m.subject, m.hdr, m.data, m.ts);
            }
        }
        for f in ["s.0", "s.1", "s.2", "s.3", ">"] {
            out += &format!(
                "{f} {} {} {:?}\n",
                st.num_pending(1, f, false),
                st.num_pending(1, f, true),
                st.load_last(f).map(|m| m.seq).ok()
            );
        }
        out
    }

    proptest! {
        /// A rollback gives back exactly the store of the last sync, whatever came between.
        #[test]
        fn discard_unsynced_restores_the_last_sync(
            before in proptest::collection::vec(op(), 0..40),
            after in proptest::collection::vec(op(), 0..40),
            again in proptest::collection::vec(op(), 0..10),
        ) {
            let mut st = MemStore::new(Limits::default());
            let mut ts = 0;
            for o in &before {
                run(&mut st, o, &mut ts);
            }
            st.set_applied(b"one").unwrap();
            st.sync().unwrap();
            let want = dump(&st);
            for o in &after {
                run(&mut st, o, &mut ts);
            }
            st.set_applied(b"two").unwrap();
            st.discard_unsynced().unwrap();
            prop_assert_eq!(dump(&st), want.clone());
            // And the store goes on from there as if nothing had happened.
            let mut fresh = MemStore::new(Limits::default());
            let mut ts2 = 0;
            for o in &before {
                run(&mut fresh, o, &mut ts2);
            }
            fresh.set_applied(b"one").unwrap();
            let mut ts1 = ts2;
            for o in &again {
                run(&mut st, o, &mut ts1);
                run(&mut fresh, o, &mut ts2);
            }
            prop_assert_eq!(dump(&st), dump(&fresh));
        }
    }

    #[test]
    fn a_store_without_a_marker_does_not_roll_back() {
        let mut st = MemStore::new(Limits::default());
        st.store_msg(b"a", b"", b"1", 1).unwrap();
        assert!(st.discard_unsynced().is_err());
        assert!(st.core.removed.is_empty());
    }
}
