//! A file store's sequence reservation (`seq.reserve`): a promise, made durable by the
//! sync that needs it, that no sequence above `upto` has been handed out, naming the
//! segment that was active then. The segments' heads prove the highest sequence handed out
//! only while those segments are there; should the newest go missing (removed from
//! outside, a directory entry lost with its disk), recovery still knows how far sequences
//! may have gone, reports the gap and never hands those sequences out again.
//!
//! Two checksummed slots written in turn, as the segment heads: the valid one with the
//! highest generation holds. A replica's store keeps none (its sequences come from its
//! group's log, which it applies again).

use crate::io::Fs;
use std::path::Path;

pub(crate) const RESERVE_FILE: &str = "seq.reserve";

/// Sequences reserved ahead of the last one handed out: the record is written again about
/// once per this many messages (and when a segment is created); at most this many are
/// skipped after the newest segments went missing.
pub(crate) const RESERVE_AHEAD: u64 = 1 << 20;

/// The reservation file's place among the segment files a sync job fsyncs (segment ids
/// count up from 1 and never get near it).
pub(crate) const RESERVE_ID: u32 = u32::MAX;

pub(crate) const SLOT: usize = 32;
const MAGIC: u32 = 0x5653_524B; // "KRSV", little-endian

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// Counts up with each write: the newer of the two slots.
    pub gen: u64,
    /// No sequence above this was handed out.
    pub upto: u64,
    /// The active segment when it was written: that one, or a newer one, must be there.
    pub segment: u32,
}

pub(crate) fn encode(r: &Reservation) -> [u8; SLOT] {
    let mut b = [0u8; SLOT];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&r.gen.to_le_bytes());
    b[12..20].copy_from_slice(&r.upto.to_le_bytes());
    b[20..24].copy_from_slice(&r.segment.to_le_bytes());
    let crc = crc32fast::hash(&b[..24]);
    b[24..28].copy_from_slice(&crc.to_le_bytes());
    b
}

pub(crate) fn decode(b: &[u8]) -> Option<Reservation> {
    let b = b.get(..SLOT)?;
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    if u32_at(0) != MAGIC || u32_at(24) != crc32fast::hash(&b[..24]) {
        return None;
    }
    Some(Reservation {
        gen: u64_at(4),
        upto: u64_at(12),
        segment: u32_at(20),
    })
}

/// The valid record with the highest generation in `dir`, if any, and the slot to write
/// next (the other one).
pub(crate) fn read(fs: &dyn Fs, dir: &Path) -> (Option<Reservation>, u8) {
    let Ok(f) = fs.open(&dir.join(RESERVE_FILE), false) else {
        return (None, 0);
    };
    let mut b = [0u8; 2 * SLOT];
    let len = f.len().unwrap_or(0).min(b.len() as u64) as usize;
    if len == 0 || f.read_at(&mut b[..len], 0).is_err() {
        return (None, 0);
    }
    let slots = [decode(&b[..SLOT]), decode(&b[SLOT..])];
    match (slots[0], slots[1]) {
        (Some(a), Some(c)) if c.gen > a.gen => (Some(c), 0),
        (Some(a), _) => (Some(a), 1),
        (None, Some(c)) => (Some(c), 0),
        (None, None) => (None, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_damage_is_refused() {
        let r = Reservation {
            gen: 7,
            upto: 1 << 40,
            segment: 12,
        };
        let b = encode(&r);
        assert_eq!(decode(&b), Some(r));
        for i in 0..28 {
            let mut d = b;
            d[i] ^= 0x10;
            assert_eq!(decode(&d), None, "byte {i}");
        }
        assert_eq!(decode(&[0u8; SLOT]), None);
        assert_eq!(decode(&b[..SLOT - 1]), None);
    }
}
