//! A consumer's replicated state: what a follower needs to take over (delivered, ack
//! floor, pending deliveries, delivery counts), changed only by [`Replicated::apply`] of a
//! [`ConsumerOp`]. No clock, no I/O, no config: the leader (`consumer.rs`) decides an op
//! from the config and the store, applies it here, and keeps its own delivery state
//! (waiting pulls, ack deadlines, the redelivery queue, flow control, heartbeats) apart.
//! Applying the same ops in the same order gives the same state, which is what Raft needs
//! (issue 15); today the state is persisted as a checksummed snapshot (`state.json`).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

/// `{consumer_seq, stream_seq}` as info shows it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqPair {
    pub consumer_seq: u64,
    pub stream_seq: u64,
}

/// One change to the replicated state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConsumerOp {
    /// Start (a new consumer, or a saved state that cannot be trusted) just before stream
    /// sequence `seq`: nothing delivered or acked before it.
    Start { seq: u64 },
    /// Stream sequence `sseq` went out as consumer sequence `cseq`, its `deliveries`-th
    /// time; `tracked` (an ack is expected) keeps it pending, otherwise it counts as acked.
    Delivered {
        sseq: u64,
        cseq: u64,
        deliveries: u64,
        tracked: bool,
    },
    /// A delivery nobody received is taken back: the state before it (`before` as
    /// recorded by [`Replicated::undo_point`]).
    Undo { sseq: u64, before: UndoPoint },
    /// An explicit ack of `sseq`: it is done with.
    Ack { sseq: u64 },
    /// `+TERM` of `sseq`: done with, never redelivered.
    Term { sseq: u64 },
    /// An ack with policy `all`: everything pending up to `sseq` is done with.
    AckAll { sseq: u64 },
    /// Out of delivery attempts: no longer pending, its delivery count kept.
    GiveUp { sseq: u64 },
    /// Gone from the stream (deleted, expired) before it could be redelivered.
    Gone { sseq: u64 },
    /// The stream ends at `last` (a saved state ahead of it): nothing past `last`.
    Clamp { last: u64 },
    /// `$JS.API.CONSUMER.RESET`: start again just before `seq`, nothing pending.
    Reset { seq: u64 },
    /// The stream was purged up to `first` (its first sequence now): what was pending
    /// before it is gone, not waited for; nothing before it is delivered.
    Purged { first: u64 },
}

/// What a delivery may change, so an undo can put it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UndoPoint {
    delivered: SeqPair,
    ack_floor: SeqPair,
    pending: Option<u64>,
    redelivered: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replicated {
    pub delivered: SeqPair,
    pub ack_floor: SeqPair,
    /// Delivered and not acked: stream seq -> consumer seq.
    pub pending: BTreeMap<u64, u64>,
    /// Deliveries so far of messages delivered more than once.
    pub redelivered: HashMap<u64, u64>,
}

/// What an op did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// The state changed (it should be saved).
    pub changed: bool,
    /// Stream sequences the consumer is now done with (acked or terminated).
    pub done: Vec<u64>,
}

impl Applied {
    fn changed() -> Applied {
        Applied {
            changed: true,
            done: vec![],
        }
    }
}

impl Replicated {
    /// The only place the state changes.
    pub fn apply(&mut self, op: &ConsumerOp) -> Applied {
        match *op {
            ConsumerOp::Start { seq } => {
                self.delivered.stream_seq = seq.saturating_sub(1);
                self.ack_floor.stream_seq = seq.saturating_sub(1);
                Applied::changed()
            }
            ConsumerOp::Delivered {
                sseq,
                cseq,
                deliveries,
                tracked,
            } => {
                self.delivered.consumer_seq = cseq;
                if deliveries == 1 {
                    self.delivered.stream_seq = self.delivered.stream_seq.max(sseq);
                } else {
                    self.redelivered.insert(sseq, deliveries);
                }
                if tracked {
                    self.pending.insert(sseq, cseq);
                } else {
                    self.update_floor();
                }
                Applied::changed()
            }
            ConsumerOp::Undo { sseq, before } => {
                self.delivered = before.delivered;
                self.ack_floor = before.ack_floor;
                match before.pending {
                    Some(c) => self.pending.insert(sseq, c),
                    None => self.pending.remove(&sseq),
                };
                match before.redelivered {
                    Some(n) => self.redelivered.insert(sseq, n),
                    None => self.redelivered.remove(&sseq),
                };
                Applied::changed()
            }
            ConsumerOp::Ack { sseq } | ConsumerOp::Term { sseq } => {
                if self.pending.remove(&sseq).is_none() {
                    return Applied::default();
                }
                self.redelivered.remove(&sseq);
                self.update_floor();
                Applied {
                    changed: true,
                    done: vec![sseq],
                }
            }
            ConsumerOp::AckAll { sseq } => {
                let rest = self.pending.split_off(&(sseq.saturating_add(1)));
                let acked = std::mem::replace(&mut self.pending, rest);
                if acked.is_empty() {
                    return Applied::default();
                }
                for s in acked.keys() {
                    self.redelivered.remove(s);
                }
                self.update_floor();
                Applied {
                    changed: true,
                    done: acked.into_keys().collect(),
                }
            }
            ConsumerOp::GiveUp { sseq } => {
                self.pending.remove(&sseq);
                self.update_floor();
                Applied::changed()
            }
            ConsumerOp::Gone { sseq } => {
                self.pending.remove(&sseq);
                self.redelivered.remove(&sseq);
                self.update_floor();
                Applied::changed()
            }
            ConsumerOp::Clamp { last } => {
                if self.delivered.stream_seq <= last {
                    return Applied::default();
                }
                self.delivered.stream_seq = last;
                self.ack_floor.stream_seq = self.ack_floor.stream_seq.min(last);
                self.pending.split_off(&(last + 1));
                Applied::changed()
            }
            ConsumerOp::Purged { first } => {
                let floor = first.saturating_sub(1);
                let rest = self.pending.split_off(&first);
                let gone = std::mem::replace(&mut self.pending, rest);
                for s in gone.keys() {
                    self.redelivered.remove(s);
                }
                let moved = self.delivered.stream_seq < floor;
                if moved {
                    self.delivered.stream_seq = floor;
                }
                if gone.is_empty() && !moved {
                    return Applied::default();
                }
                self.update_floor();
                Applied {
                    changed: true,
                    done: gone.into_keys().collect(),
                }
            }
            ConsumerOp::Reset { seq } => {
                self.pending.clear();
                self.redelivered.clear();
                self.delivered = SeqPair {
                    consumer_seq: 0,
                    stream_seq: seq.saturating_sub(1),
                };
                self.ack_floor = self.delivered;
                Applied::changed()
            }
        }
    }

    /// What a delivery of `sseq` would change, for [`ConsumerOp::Undo`].
    pub fn undo_point(&self, sseq: u64) -> UndoPoint {
        UndoPoint {
            delivered: self.delivered,
            ack_floor: self.ack_floor,
            pending: self.pending.get(&sseq).copied(),
            redelivered: self.redelivered.get(&sseq).copied(),
        }
    }

    /// Deliveries of `sseq` so far (1 unless redelivered).
    pub fn deliveries(&self, sseq: u64) -> u64 {
        self.redelivered.get(&sseq).copied().unwrap_or(1)
    }

    /// The ack floor follows the oldest pending delivery (or everything delivered).
    fn update_floor(&mut self) {
        match self.pending.iter().next() {
            Some((&sseq, &cseq)) => {
                self.ack_floor = SeqPair {
                    consumer_seq: cseq.saturating_sub(1),
                    stream_seq: sseq.saturating_sub(1),
                }
            }
            None => self.ack_floor = self.delivered,
        }
    }

    /// The invariants a saved state must also meet: floor <= delivered, every pending
    /// delivery between them.
    pub fn consistent(&self) -> bool {
        let (floor, top) = (self.ack_floor.stream_seq, self.delivered.stream_seq);
        floor <= top && self.pending.keys().all(|&s| s > floor && s <= top)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivered(sseq: u64, cseq: u64, deliveries: u64) -> ConsumerOp {
        ConsumerOp::Delivered {
            sseq,
            cseq,
            deliveries,
            tracked: true,
        }
    }

    /// A purge up to `first` drops what was pending before it and moves delivered and the
    /// ack floor up to it, as the reference's consumer does.
    #[test]
    fn a_purge_drops_what_was_pending_before_the_new_first_sequence() {
        let mut r = Replicated::default();
        for s in 1..=3 {
            r.apply(&delivered(s, s, 1));
        }
        r.apply(&ConsumerOp::Ack { sseq: 1 });
        let a = r.apply(&ConsumerOp::Purged { first: 6 });
        assert_eq!(a.done, [2, 3]);
        assert!(r.pending.is_empty());
        assert_eq!(
            r.delivered,
            SeqPair {
                consumer_seq: 3,
                stream_seq: 5
            }
        );
        assert_eq!(r.ack_floor, r.delivered);
        // Pending past the purge stays, and holds the floor below it.
        r.apply(&delivered(7, 4, 1));
        r.apply(&delivered(8, 5, 1));
        let a = r.apply(&ConsumerOp::Purged { first: 8 });
        assert_eq!(a.done, [7]);
        assert_eq!(
            r.ack_floor,
            SeqPair {
                consumer_seq: 4,
                stream_seq: 7
            }
        );
        // Nothing to change: nothing changes.
        assert!(!r.apply(&ConsumerOp::Purged { first: 2 }).changed);
        assert!(r.consistent());
    }

    #[test]
    fn acks_move_the_floor_to_the_oldest_pending() {
        let mut r = Replicated::default();
        for s in 1..=3 {
            r.apply(&delivered(s, s, 1));
        }
        assert_eq!(r.ack_floor, SeqPair::default());
        assert_eq!(r.apply(&ConsumerOp::Ack { sseq: 2 }).done, vec![2]);
        assert_eq!(r.ack_floor.stream_seq, 0);
        r.apply(&ConsumerOp::Ack { sseq: 1 });
        assert_eq!(
            r.ack_floor,
            SeqPair {
                consumer_seq: 2,
                stream_seq: 2
            }
        );
        // Acking what is not pending changes nothing.
        assert_eq!(r.apply(&ConsumerOp::Ack { sseq: 1 }), Applied::default());
        r.apply(&ConsumerOp::Ack { sseq: 3 });
        assert_eq!(r.ack_floor, r.delivered);
        assert!(r.pending.is_empty());
    }

    #[test]
    fn ack_all_takes_everything_up_to_it() {
        let mut r = Replicated::default();
        for s in [2, 4, 6] {
            r.apply(&delivered(s, s / 2, 1));
        }
        assert_eq!(r.apply(&ConsumerOp::AckAll { sseq: 4 }).done, vec![2, 4]);
        assert_eq!(r.pending.keys().copied().collect::<Vec<_>>(), vec![6]);
        assert_eq!(r.ack_floor.stream_seq, 5);
        assert_eq!(r.apply(&ConsumerOp::AckAll { sseq: 5 }), Applied::default());
    }

    #[test]
    fn redelivery_counts_and_undo() {
        let mut r = Replicated::default();
        r.apply(&delivered(1, 1, 1));
        let before = r.clone();
        let point = r.undo_point(1);
        r.apply(&delivered(1, 2, 2));
        assert_eq!(r.deliveries(1), 2);
        assert_eq!(r.pending[&1], 2);
        r.apply(&ConsumerOp::Undo {
            sseq: 1,
            before: point,
        });
        assert_eq!(r, before);
        // A give-up keeps the count, a gone message drops it.
        r.apply(&delivered(1, 2, 2));
        r.apply(&ConsumerOp::GiveUp { sseq: 1 });
        assert!(r.pending.is_empty());
        assert_eq!(r.deliveries(1), 2);
        r.apply(&delivered(5, 3, 1));
        r.apply(&delivered(5, 4, 2));
        r.apply(&ConsumerOp::Gone { sseq: 5 });
        assert_eq!(r.deliveries(5), 1);
    }

    #[test]
    fn untracked_deliveries_are_acked_at_once() {
        let mut r = Replicated::default();
        r.apply(&ConsumerOp::Delivered {
            sseq: 7,
            cseq: 1,
            deliveries: 1,
            tracked: false,
        });
        assert!(r.pending.is_empty());
        assert_eq!(r.ack_floor, r.delivered);
        assert_eq!(r.delivered.stream_seq, 7);
    }

    #[test]
    fn clamp_and_reset() {
        let mut r = Replicated::default();
        for s in 1..=10 {
            r.apply(&delivered(s, s, 1));
        }
        r.apply(&ConsumerOp::Ack { sseq: 1 });
        r.apply(&ConsumerOp::Clamp { last: 6 });
        assert_eq!(r.delivered.stream_seq, 6);
        assert_eq!(r.pending.keys().max(), Some(&6));
        assert!(r.consistent());
        r.apply(&ConsumerOp::Reset { seq: 4 });
        assert!(r.pending.is_empty() && r.redelivered.is_empty());
        assert_eq!(r.delivered.stream_seq, 3);
        assert_eq!(r.ack_floor, r.delivered);
    }

    /// Any sequence of ops a leader can produce keeps floor <= delivered with every
    /// pending delivery between them and the floor just below the oldest pending, and
    /// replaying the ops gives the same state.
    #[test]
    fn random_ops_keep_the_invariants_and_replay_the_same() {
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for _ in 0..200 {
            let mut r = Replicated::default();
            let mut log = vec![];
            let mut next_new = 1u64;
            for _ in 0..300 {
                let pending: Vec<u64> = r.pending.keys().copied().collect();
                let pick = |i: u64| pending[(i as usize) % pending.len()];
                let op = match next(8) {
                    0..=2 => {
                        let sseq = next_new;
                        next_new += 1 + next(2);
                        ConsumerOp::Delivered {
                            sseq,
                            cseq: r.delivered.consumer_seq + 1,
                            deliveries: 1,
                            tracked: next(10) != 0,
                        }
                    }
                    3 if !pending.is_empty() => {
                        let sseq = pick(next(64));
                        ConsumerOp::Delivered {
                            sseq,
                            cseq: r.delivered.consumer_seq + 1,
                            deliveries: r.deliveries(sseq) + 1,
                            tracked: true,
                        }
                    }
                    4 if !pending.is_empty() => ConsumerOp::Ack {
                        sseq: pick(next(64)),
                    },
                    5 if !pending.is_empty() => ConsumerOp::AckAll {
                        sseq: pick(next(64)),
                    },
                    6 if !pending.is_empty() => ConsumerOp::GiveUp {
                        sseq: pick(next(64)),
                    },
                    7 if !pending.is_empty() => ConsumerOp::Gone {
                        sseq: pick(next(64)),
                    },
                    _ => ConsumerOp::Ack { sseq: next_new },
                };
                let applied = r.apply(&op);
                assert!(r.consistent(), "{r:?} after {op:?}");
                // What removes pending deliveries leaves the floor tight: just below the
                // oldest pending, or everything delivered.
                let moved = match op {
                    ConsumerOp::Delivered { tracked, .. } => !tracked,
                    _ => applied.changed,
                };
                if moved {
                    let floor = match r.pending.iter().next() {
                        Some((&s, &c)) => (s - 1, c - 1),
                        None => (r.delivered.stream_seq, r.delivered.consumer_seq),
                    };
                    let got = (r.ack_floor.stream_seq, r.ack_floor.consumer_seq);
                    assert_eq!(got, floor, "{r:?} after {op:?}");
                }
                log.push(op);
                assert!(r.delivered.stream_seq < next_new);
            }
            let mut replay = Replicated::default();
            for op in &log {
                replay.apply(op);
            }
            assert_eq!(replay, r);
        }
    }
}
