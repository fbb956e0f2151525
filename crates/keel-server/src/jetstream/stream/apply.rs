//! The deterministic half: [`apply`] changes a store by one [`StreamEntry`], with no clock
//! and no I/O beyond the store's own writes. A replica applying the same entries in the
//! same order ends with the same store; the leader applies them the same way.

use keel_store::{Purge, Store, StoreError};

use super::entry::{Rollup, StreamEntry};

/// What an entry did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A message stored at this sequence.
    Stored(u64),
    /// How many messages a purge removed.
    Purged(u64),
    /// How many of the listed sequences were there and went.
    Removed(u64),
    /// How many messages max_age expired.
    Expired(u64),
    Done,
}

pub fn apply(store: &mut dyn Store, entry: &StreamEntry) -> Result<Applied, StoreError> {
    match entry {
        StreamEntry::Msg(m) => {
            store.store_at(m.seq, &m.subject, &m.hdr, &m.data, m.ts)?;
            if m.no_max_age {
                store.exempt_from_max_age(m.seq);
            }
            if let Some(r) = m.rollup {
                let filter = match r {
                    Rollup::Sub => Some(String::from_utf8_lossy(&m.subject).into_owned()),
                    Rollup::All => None,
                };
                store.purge(&Purge {
                    filter,
                    seq: None,
                    keep: Some(1),
                })?;
            }
            Ok(Applied::Stored(m.seq))
        }
        StreamEntry::Purge { filter, seq, keep } => store
            .purge(&Purge {
                filter: filter.clone(),
                seq: *seq,
                keep: *keep,
            })
            .map(Applied::Purged),
        StreamEntry::Remove { seqs, erase } => {
            let mut n = 0;
            for &s in seqs {
                n += store.remove(s, *erase)? as u64;
            }
            Ok(Applied::Removed(n))
        }
        StreamEntry::ExpireUpTo { ts } => store.expire(*ts).map(|(n, _)| Applied::Expired(n)),
        StreamEntry::SkipTo { next } => store.skip_to(*next).map(|_| Applied::Done),
        StreamEntry::Config(cfg) => store.set_limits(cfg.limits()).map(|_| Applied::Done),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jetstream::stream::entry::MsgEntry;
    use bytes::Bytes;
    use keel_store::MemStore;

    fn msg(seq: u64, subject: &'static str, rollup: Option<Rollup>) -> StreamEntry {
        StreamEntry::Msg(MsgEntry {
            seq,
            ts: seq as i64 * 1000,
            subject: Bytes::from_static(subject.as_bytes()),
            hdr: Bytes::new(),
            data: Bytes::from_static(b"x"),
            rollup,
            no_max_age: seq == 2,
        })
    }

    /// Two replicas applying the same entries (which went through serde, as a log would
    /// carry them) agree on everything.
    #[test]
    fn replicas_agree() {
        let entries = vec![
            msg(1, "a", None),
            msg(2, "a", None),
            msg(5, "b", None),
            StreamEntry::Remove {
                seqs: vec![1, 9],
                erase: false,
            },
            msg(6, "b", Some(Rollup::Sub)),
            StreamEntry::ExpireUpTo { ts: 10_000 },
            StreamEntry::SkipTo { next: 10 },
            msg(10, "c", None),
            StreamEntry::Purge {
                filter: Some("c".into()),
                seq: None,
                keep: None,
            },
        ];
        let wire = serde_json::to_string(&entries).unwrap();
        let replayed: Vec<StreamEntry> = serde_json::from_str(&wire).unwrap();
        assert_eq!(replayed, entries);
        let limits = keel_store::Limits {
            max_age: std::time::Duration::from_nanos(4_500),
            ..Default::default()
        };
        let mut a = MemStore::new(limits.clone());
        let mut b = MemStore::new(limits);
        let outcomes: Vec<Applied> = entries.iter().map(|e| apply(&mut a, e).unwrap()).collect();
        for e in &replayed {
            apply(&mut b, e).unwrap();
        }
        assert_eq!(a.snapshot(), b.snapshot());
        assert_eq!(a.state(), b.state());
        assert_eq!(outcomes[3], Applied::Removed(1));
        // 5 rolled up by 6; 2 is exempt from max_age, 6 is too new to expire.
        let live: Vec<u64> = (1..=10).filter(|q| a.load(*q).is_ok()).collect();
        assert_eq!(live, vec![2, 6]);
        assert_eq!(a.state().last_seq, 10);
        // Applying never picks a sequence: an entry at or below the last one is refused.
        assert!(apply(&mut a, &msg(10, "d", None)).is_err());
    }
}
