//! The on-disk record: a fixed 40-byte header and the subject, headers and payload.
//!
//! ```text
//!  0 magic u32 "KEEL"    4 len u32 (whole record)   8 crc32 u32 over len and bytes 12..len
//! 12 kind u8            13 reserved u8             14 subject len u16
//! 16 seq u64            24 ts i64
//! 32 hdr len u32        36 data len u32             40 subject, hdr, data
//! ```
//!
//! The CRC covers the length too, so a flipped length bit cannot make a shorter or longer
//! slice of bytes look valid. All integers are little-endian. Kinds: messages, tombstones,
//! markers and erased messages (appended), the ledger (appended whole when it changes), the
//! applied marker (appended at a sync), and the head (two fixed slots at the start of a segment, rewritten in place at each sync).

pub(crate) const MAGIC: [u8; 4] = *b"KEEL";
pub(crate) const HDR: usize = 40;
/// Upper bound on one record (the slot keeps the length in 31 bits).
pub(crate) const MAX_RECORD: usize = (1 << 31) - 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A message.
    Msg = 1,
    /// "Sequence `seq` was removed."
    Tomb = 2,
    /// "Everything below `seq` is gone"; `ts` is the stream's last_ts and the 8-byte body
    /// its last_seq, so an emptied stream keeps its sequence after restart.
    Marker = 3,
    /// A message erased in place: same length, payload zeroed.
    Erased = 4,
    /// The fixed-size first record of a segment, rewritten in place at every sync (see
    /// [`Head`]).
    Head = 5,
    /// The ledger of sequences that are gone with deleted segments or were lost (see
    /// [`Ledger`]); each one written holds the whole ledger.
    Ledger = 6,
    /// What a compaction kept: `seq` is the first sequence of the segment's range, the
    /// body the last (u64) and a bitmap over the range of the messages copied. Every other
    /// sequence of the range was removed durably before the compaction.
    Claim = 7,
    /// The applied marker, the last record a sync appends when the store has one: the body
    /// is the marker (length u8, bytes) and the stretches of segment records the sync
    /// wrote (count u32, then segment id u32, from u64, to u64 each); `seq` and `ts` are
    /// last_seq and last_ts. Recovery trusts the newest one whose stretches are all intact
    /// and cuts what was written after it (see `FileStore::set_applied`).
    Applied = 8,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Msg,
            2 => Kind::Tomb,
            3 => Kind::Marker,
            4 => Kind::Erased,
            5 => Kind::Head,
            6 => Kind::Ledger,
            7 => Kind::Claim,
            8 => Kind::Applied,
            _ => return None,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Rec<'a> {
    pub kind: Kind,
    pub seq: u64,
    pub ts: i64,
    pub subj: &'a [u8],
    pub hdr: &'a [u8],
    pub data: &'a [u8],
    pub len: usize,
    pub crc: u32,
}

pub(crate) enum Parse<'a> {
    Ok(Rec<'a>),
    /// Not a valid record here (bad magic, length, checksum or fields).
    Bad,
}

pub(crate) fn record_len(subj: usize, hdr: usize, data: usize) -> usize {
    HDR + subj + hdr + data
}

fn crc(rec: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&rec[4..8]);
    h.update(&rec[12..]);
    h.finalize()
}

/// Appends a record to `buf`; returns its CRC.
pub(crate) fn encode(
    buf: &mut Vec<u8>,
    kind: Kind,
    seq: u64,
    ts: i64,
    subj: &[u8],
    hdr: &[u8],
    data: &[u8],
) -> u32 {
    let start = buf.len();
    let len = record_len(subj.len(), hdr.len(), data.len());
    buf.reserve(len);
    buf.extend_from_slice(&MAGIC);
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.push(kind as u8);
    buf.push(0);
    buf.extend_from_slice(&(subj.len() as u16).to_le_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&ts.to_le_bytes());
    buf.extend_from_slice(&(hdr.len() as u32).to_le_bytes());
    buf.extend_from_slice(&(data.len() as u32).to_le_bytes());
    buf.extend_from_slice(subj);
    buf.extend_from_slice(hdr);
    buf.extend_from_slice(data);
    let c = crc(&buf[start..]);
    buf[start + 8..start + 12].copy_from_slice(&c.to_le_bytes());
    c
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

/// The record at the start of `b`, fully validated. Never panics on any input.
pub(crate) fn parse(b: &[u8]) -> Parse<'_> {
    if b.len() < HDR || b[0..4] != MAGIC {
        return Parse::Bad;
    }
    let len = u32_at(b, 4) as usize;
    if !(HDR..=MAX_RECORD).contains(&len) || len > b.len() {
        return Parse::Bad;
    }
    let rec = &b[..len];
    let stored = u32_at(rec, 8);
    if crc(rec) != stored {
        return Parse::Bad;
    }
    let Some(kind) = Kind::from_u8(rec[12]) else {
        return Parse::Bad;
    };
    let sl = u16::from_le_bytes([rec[14], rec[15]]) as usize;
    let hl = u32_at(rec, 32) as usize;
    let dl = u32_at(rec, 36) as usize;
    if HDR
        .checked_add(sl)
        .and_then(|x| x.checked_add(hl))
        .and_then(|x| x.checked_add(dl))
        != Some(len)
    {
        return Parse::Bad;
    }
    Parse::Ok(Rec {
        kind,
        seq: u64_at(rec, 16),
        ts: u64_at(rec, 24) as i64,
        subj: &rec[HDR..HDR + sl],
        hdr: &rec[HDR + sl..HDR + sl + hl],
        data: &rec[HDR + sl + hl..len],
        len,
        crc: stored,
    })
}

/// The sequence a damaged stretch's first record claims, if its header still looks like
/// a message record's.
pub(crate) fn claimed_seq(b: &[u8]) -> Option<u64> {
    (b.len() >= 24 && b[0..4] == MAGIC && matches!(b[12], 1 | 4)).then(|| u64_at(b, 16))
}

/// Does the damaged stretch `b` consist exactly of message records whose headers are
/// intact and whose sequences were removed, possibly followed by zeros (the free space of
/// a preallocated file)? That is what interrupted in-place erases leave (the header
/// survives, the payload and checksum do not).
pub(crate) fn only_torn_erases(b: &[u8], removed: impl Fn(u64) -> bool) -> bool {
    let mut o = 0;
    while o < b.len() {
        let r = &b[o..];
        if r.iter().all(|&x| x == 0) {
            return o > 0;
        }
        if r.len() < HDR || r[0..4] != MAGIC || !matches!(r[12], 1 | 4) {
            return false;
        }
        let len = u32_at(r, 4) as usize;
        if len < HDR || len > r.len() || !removed(u64_at(r, 16)) {
            return false;
        }
        o += len;
    }
    !b.is_empty()
}

/// Rewrites a valid message record in place as an erased one (payload zeroed, new CRC).
/// Returns the new CRC.
pub(crate) fn erase_in_place(rec: &mut [u8]) -> u32 {
    rec[12] = Kind::Erased as u8;
    rec[HDR..].fill(0);
    let c = crc(rec);
    rec[8..12].copy_from_slice(&c.to_le_bytes());
    c
}

/// Offset of the next position at or after `from` where a valid record starts.
pub(crate) fn resync(b: &[u8], from: usize) -> Option<usize> {
    let mut o = from;
    while o + HDR <= b.len() {
        let rel = b[o..].windows(4).position(|w| w == MAGIC)?;
        o += rel;
        if let Parse::Ok(_) = parse(&b[o..]) {
            return Some(o);
        }
        o += 1;
    }
    None
}

/// Length of one head record.
pub(crate) const HEAD_LEN: usize = HDR + 32;
/// Every segment starts with two head slots, rewritten alternately, so a torn rewrite
/// always leaves the previous head intact in the other.
pub(crate) const HEADS_LEN: usize = 2 * HEAD_LEN;

/// What a segment's head says, as of the sync that last wrote it. Sequence numbers must
/// outlive the records that carry them (a disk can lose the tail of a file it synced), so
/// every sync also records the highest sequence handed out here, outside the tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Head {
    /// last_seq and last_ts when the head was written (the sync in progress).
    pub pending: u64,
    pub ts: i64,
    /// Completed syncs when the segment was created.
    pub created: u64,
    /// Completed syncs when the head was written.
    pub synced: u64,
    /// last_seq as of the last completed sync: everything up to it was durable.
    pub synced_seq: u64,
    /// This segment's length as of the last completed sync.
    pub synced_len: u64,
}

pub(crate) fn encode_head(h: &Head) -> Vec<u8> {
    let mut data = Vec::with_capacity(32);
    for v in [h.created, h.synced, h.synced_seq, h.synced_len] {
        data.extend_from_slice(&v.to_le_bytes());
    }
    let mut buf = Vec::with_capacity(HEAD_LEN);
    encode(&mut buf, Kind::Head, h.pending, h.ts, b"", b"", &data);
    debug_assert_eq!(buf.len(), HEAD_LEN);
    buf
}

pub(crate) enum HeadParse {
    Ok(Head),
    /// Shaped like a head whose in-place rewrite was torn: the slot is there, its content
    /// unknown.
    Torn,
    /// No head: a segment from before heads existed, or not a segment at all.
    None,
}

pub(crate) fn parse_head(b: &[u8]) -> HeadParse {
    if let Parse::Ok(r) = parse(b) {
        if r.kind == Kind::Head && r.len == HEAD_LEN && r.data.len() == 32 {
            let v = |i: usize| u64_at(r.data, i * 8);
            return HeadParse::Ok(Head {
                pending: r.seq,
                ts: r.ts,
                created: v(0),
                synced: v(1),
                synced_seq: v(2),
                synced_len: v(3),
            });
        }
        return HeadParse::None;
    }
    if b.len() >= 13
        && b[0..4] == MAGIC
        && u32_at(b, 4) as usize == HEAD_LEN
        && b[12] == Kind::Head as u8
    {
        return HeadParse::Torn;
    }
    HeadParse::None
}

/// The start of a segment whose creation was cut short: empty, or part of its heads.
pub(crate) fn is_heads_prefix(b: &[u8]) -> bool {
    let n = b.len().min(4);
    b.len() < HEADS_LEN
        && b[..n] == MAGIC[..n]
        && match parse(b) {
            Parse::Ok(r) => r.kind == Kind::Head,
            Parse::Bad => true,
        }
}

/// The body of a claim record: the range's last sequence and the bitmap of what it holds.
pub(crate) fn encode_claim(hi: u64, bits: &[u8]) -> Vec<u8> {
    let mut d = Vec::with_capacity(8 + bits.len());
    d.extend_from_slice(&hi.to_le_bytes());
    d.extend_from_slice(bits);
    d
}

/// (last sequence, bitmap) of a claim whose range starts at `lo`, if well formed.
pub(crate) fn decode_claim(lo: u64, d: &[u8]) -> Option<(u64, &[u8])> {
    let hi = u64::from_le_bytes(d.get(..8)?.try_into().ok()?);
    let bits = &d[8..];
    (hi >= lo && (hi - lo) / 8 + 1 == bits.len() as u64).then_some((hi, bits))
}

/// Sequences the ledger accounts for: `gone` ranges belonged to deleted segments (or were
/// handed out and never written), `lost` ranges were damaged or missing; `lost_bytes` is
/// what the lost records took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Ledger {
    pub gone: Vec<(u64, u64)>,
    pub lost: Vec<(u64, u64)>,
    pub lost_bytes: u64,
}

pub(crate) fn encode_ledger(l: &Ledger) -> Vec<u8> {
    let mut d = Vec::with_capacity(16 + 16 * (l.gone.len() + l.lost.len()));
    for list in [&l.gone, &l.lost] {
        d.extend_from_slice(&(list.len() as u32).to_le_bytes());
        for &(a, b) in list {
            d.extend_from_slice(&a.to_le_bytes());
            d.extend_from_slice(&b.to_le_bytes());
        }
    }
    d.extend_from_slice(&l.lost_bytes.to_le_bytes());
    d
}

pub(crate) fn decode_ledger(d: &[u8]) -> Option<Ledger> {
    let mut o = 0;
    let mut lists = [Vec::new(), Vec::new()];
    for list in &mut lists {
        let n = u32::from_le_bytes(d.get(o..o + 4)?.try_into().ok()?) as usize;
        o += 4;
        if d.len() < o + n.checked_mul(16)? {
            return None;
        }
        for _ in 0..n {
            let a = u64_at(d, o);
            let b = u64_at(d, o + 8);
            o += 16;
            if a > b {
                return None;
            }
            list.push((a, b));
        }
    }
    let lost_bytes = u64::from_le_bytes(d.get(o..o + 8)?.try_into().ok()?);
    if o + 8 != d.len() {
        return None;
    }
    let [gone, lost] = lists;
    Some(Ledger {
        gone,
        lost,
        lost_bytes,
    })
}
