//! Sets of sequence numbers kept as merged inclusive ranges: the file store's ledger of
//! sequences whose segment was deleted ("gone") and of sequences that were lost.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `lo..=hi`, merging with overlapping or adjacent ranges. Returns true if
    /// anything new was added.
    pub fn insert(&mut self, lo: u64, hi: u64) -> bool {
        if lo > hi || self.covers(lo, hi) {
            return false;
        }
        let (mut lo, mut hi) = (lo, hi);
        if let Some((&a, &b)) = self.0.range(..=lo).next_back() {
            if b.saturating_add(1) >= lo {
                lo = a;
                hi = hi.max(b);
            }
        }
        let absorbed: Vec<u64> = self
            .0
            .range(lo..=hi.saturating_add(1))
            .map(|(&a, _)| a)
            .collect();
        for a in absorbed {
            let b = self.0.remove(&a).unwrap();
            hi = hi.max(b);
        }
        self.0.insert(lo, hi);
        true
    }

    pub fn contains(&self, s: u64) -> bool {
        self.0.range(..=s).next_back().is_some_and(|(_, &b)| b >= s)
    }

    /// Does any range overlap `lo..=hi`?
    pub fn intersects(&self, lo: u64, hi: u64) -> bool {
        lo <= hi && self.gaps(lo, hi) != [(lo, hi)]
    }

    fn covers(&self, lo: u64, hi: u64) -> bool {
        self.0
            .range(..=lo)
            .next_back()
            .is_some_and(|(_, &b)| b >= hi)
    }

    /// Drops everything below `m`.
    pub fn prune_below(&mut self, m: u64) {
        let below: Vec<u64> = self.0.range(..m).map(|(&a, _)| a).collect();
        for a in below {
            let b = self.0.remove(&a).unwrap();
            if b >= m {
                self.0.insert(m, b);
            }
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(&a, &b)| (a, b))
    }

    pub fn union(&mut self, other: &Ranges) {
        for (a, b) in other.iter() {
            self.insert(a, b);
        }
    }

    /// Number of sequences covered.
    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.iter().map(|(a, b)| b - a + 1).sum()
    }

    /// Every sequence, in order.
    pub fn expand(&self) -> Vec<u64> {
        self.iter().flat_map(|(a, b)| a..=b).collect()
    }

    /// The parts of `lo..=hi` not covered.
    pub fn gaps(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if lo > hi {
            return out;
        }
        let mut at = lo;
        let start = self
            .0
            .range(..=lo)
            .next_back()
            .map_or(lo, |(&a, _)| a.min(lo));
        for (&a, &b) in self.0.range(start..=hi) {
            if b < at {
                continue;
            }
            if a > at {
                out.push((at, a - 1));
            }
            if b >= hi {
                return out;
            }
            at = b + 1;
        }
        out.push((at, hi));
        out
    }
}

/// Inclusive ranges from sorted, deduplicated sequences.
pub(crate) fn to_ranges(seqs: impl IntoIterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for s in seqs {
        match out.last_mut() {
            Some((_, b)) if *b + 1 == s => *b = s,
            _ => out.push((s, s)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_gaps_prune() {
        let mut r = Ranges::default();
        assert!(r.insert(5, 7));
        assert!(r.insert(10, 12));
        assert!(!r.insert(6, 7));
        assert!(r.insert(8, 9));
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(5, 12)]);
        r.insert(20, 20);
        assert_eq!(r.gaps(1, 25), vec![(1, 4), (13, 19), (21, 25)]);
        assert_eq!(r.gaps(6, 11), vec![]);
        assert_eq!(r.gaps(12, 20), vec![(13, 19)]);
        assert!(r.contains(20) && r.contains(5) && !r.contains(13));
        r.prune_below(7);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(7, 12), (20, 20)]);
        assert_eq!(r.count(), 7);
        r.insert(1, 30);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(1, 30)]);
        assert_eq!(
            to_ranges([1, 2, 3, 7, 9, 10]),
            vec![(1, 3), (7, 7), (9, 10)]
        );
    }
}
