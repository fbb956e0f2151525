//! The memory store: messages live in the shared slot table (see `core`), nothing touches
//! disk, `sync` and `close` are no-ops.

use crate::index::{Core, SlotTable, Table};
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

/// Stream storage in memory.
pub struct MemStore {
    core: Core<SlotTable<MemMsg>>,
    applied: Vec<u8>,
}

impl MemStore {
    pub fn new(limits: Limits) -> Self {
        MemStore {
            core: Core::new(limits, SlotTable::new()),
            applied: Vec::new(),
        }
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

    fn settle(&mut self) {
        self.core.removed.clear();
        self.core.reset = false;
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
        self.settle();
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

    fn sync(&mut self) -> Result<()> {
        Ok(())
    }

    /// Kept as set: nothing outlives the process, so there is no older durable marker.
    fn set_applied(&mut self, marker: &[u8]) -> Result<()> {
        crate::check_applied(marker)?;
        self.applied = marker.to_vec();
        Ok(())
    }

    fn applied(&self) -> Vec<u8> {
        self.applied.clone()
    }

    /// Unsupported: the memory store keeps no copy of its state at a sync to go back to
    /// (every write takes effect at once, and nothing survives a restart anyway; a replica
    /// on a memory store rebuilds it from a snapshot and its log).
    fn discard_unsynced(&mut self) -> Result<()> {
        Err(StoreError::Unsupported(
            "the memory store keeps no synced state to roll back to",
        ))
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
