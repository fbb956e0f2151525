//! The in-memory bookkeeping both stores share: a sequence-indexed slot table, the
//! per-subject index, stream counters, limits, purge and the read-side queries. The memory
//! store keeps whole messages in the slots; the file store keeps only where each record
//! lives. Keeping one implementation is what makes the two stores agree on every semantic
//! (limits, purge variants, first/last sequence rules, pending counts).

use crate::{filter_matches, is_all, Discard, Limits, Purge, State, StoreError};
use bytes::Bytes;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// What a slot carries besides subject and timestamp.
pub(crate) trait Payload: Default {
    /// Reference byte accounting for this message, given its subject length.
    fn acct_size(&self, subj_len: usize) -> u64;
}

const NO_SUBJ: u32 = u32::MAX;

/// One sequence. `subj == NO_SUBJ` means the sequence is not live. The timestamp is split in
/// two u32 so a file-store slot packs into 20 bytes (alignment 4, not 8).
#[derive(Clone)]
pub(crate) struct Slot<P> {
    subj: u32,
    ts: [u32; 2],
    pub p: P,
}

impl<P: Default> Default for Slot<P> {
    fn default() -> Self {
        Slot {
            subj: NO_SUBJ,
            ts: [0; 2],
            p: P::default(),
        }
    }
}

impl<P> Slot<P> {
    pub fn subj_id(&self) -> u32 {
        self.subj
    }
    pub fn ts(&self) -> i64 {
        ((self.ts[1] as u64) << 32 | self.ts[0] as u64) as i64
    }
    fn live(&self) -> bool {
        self.subj != NO_SUBJ
    }
}

const CHUNK_BITS: u32 = 8;
const CHUNK: u64 = 1 << CHUNK_BITS;

struct Chunk<P> {
    live: u32,
    slots: Box<[Slot<P>]>,
}

/// Slots indexed by sequence in O(1): a deque of fixed-size chunks, where a chunk with no
/// live slot is freed (`None`). Sparse streams (a KV bucket with one old key and one hot
/// key) then cost 8 bytes per 256 sequences of gap instead of one slot per sequence.
pub(crate) struct Slots<P> {
    base: u64,
    chunks: VecDeque<Option<Box<Chunk<P>>>>,
}

impl<P: Default> Slots<P> {
    fn new() -> Self {
        Slots {
            base: 0,
            chunks: VecDeque::new(),
        }
    }

    fn chunk(&self, seq: u64) -> Option<&Chunk<P>> {
        let c = seq >> CHUNK_BITS;
        if c < self.base {
            return None;
        }
        self.chunks.get((c - self.base) as usize)?.as_deref()
    }

    pub fn get(&self, seq: u64) -> Option<&Slot<P>> {
        let s = &self.chunk(seq)?.slots[(seq & (CHUNK - 1)) as usize];
        s.live().then_some(s)
    }

    fn insert(&mut self, seq: u64, slot: Slot<P>) {
        let c = seq >> CHUNK_BITS;
        if self.chunks.is_empty() {
            self.base = c;
        }
        while c < self.base {
            self.chunks.push_front(None);
            self.base -= 1;
        }
        let i = (c - self.base) as usize;
        while self.chunks.len() <= i {
            self.chunks.push_back(None);
        }
        let ch = self.chunks[i].get_or_insert_with(|| {
            Box::new(Chunk {
                live: 0,
                slots: (0..CHUNK).map(|_| Slot::default()).collect(),
            })
        });
        let s = &mut ch.slots[(seq & (CHUNK - 1)) as usize];
        debug_assert!(!s.live());
        *s = slot;
        ch.live += 1;
    }

    fn take(&mut self, seq: u64) -> Option<Slot<P>> {
        let c = seq >> CHUNK_BITS;
        if c < self.base {
            return None;
        }
        let i = (c - self.base) as usize;
        let ch = self.chunks.get_mut(i)?.as_deref_mut()?;
        let s = &mut ch.slots[(seq & (CHUNK - 1)) as usize];
        if !s.live() {
            return None;
        }
        let out = std::mem::take(s);
        ch.live -= 1;
        if ch.live == 0 {
            self.chunks[i] = None;
            while let Some(None) = self.chunks.front() {
                self.chunks.pop_front();
                self.base += 1;
            }
            while let Some(None) = self.chunks.back() {
                self.chunks.pop_back();
            }
        }
        Some(out)
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.base = 0;
    }

    /// First live sequence in `[from, to]`.
    pub fn next_live(&self, from: u64, to: u64) -> Option<u64> {
        self.iter(from, to).next().map(|(s, _)| s)
    }

    /// Last live sequence in `[from, to]`.
    pub fn prev_live(&self, from: u64, to: u64) -> Option<u64> {
        if from > to || self.chunks.is_empty() {
            return None;
        }
        let mut c = (to >> CHUNK_BITS).min(self.base + self.chunks.len() as u64 - 1);
        let mut seq = to.min(((c + 1) << CHUNK_BITS) - 1);
        loop {
            if c < self.base || seq < from {
                return None;
            }
            if let Some(ch) = self.chunks[(c - self.base) as usize].as_deref() {
                let lo = (c << CHUNK_BITS).max(from);
                let mut s = seq;
                loop {
                    if ch.slots[(s & (CHUNK - 1)) as usize].live() {
                        return Some(s);
                    }
                    if s == lo {
                        break;
                    }
                    s -= 1;
                }
            }
            if c == 0 {
                return None;
            }
            c -= 1;
            seq = ((c + 1) << CHUNK_BITS) - 1;
        }
    }

    /// Live slots in `[from, to]`, in order, skipping freed chunks without visiting them.
    pub fn iter(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, &Slot<P>)> + '_ {
        let from = from.max(self.base << CHUNK_BITS);
        let end_chunk = self.base + self.chunks.len() as u64;
        let first_chunk = from >> CHUNK_BITS;
        (first_chunk..end_chunk)
            .take_while(move |&c| (c << CHUNK_BITS) <= to)
            .filter_map(move |c| {
                self.chunks[(c - self.base) as usize]
                    .as_deref()
                    .map(|ch| (c, ch))
            })
            .flat_map(move |(c, ch)| {
                let lo = (c << CHUNK_BITS).max(from);
                let hi = (((c + 1) << CHUNK_BITS) - 1).min(to);
                (lo..=hi).filter_map(move |s| {
                    let sl = &ch.slots[(s & (CHUNK - 1)) as usize];
                    sl.live().then_some((s, sl))
                })
            })
    }

    /// Live slots in `[from, to]`, counted per chunk where the chunk lies wholly inside.
    pub fn count(&self, from: u64, to: u64) -> u64 {
        if from > to || self.chunks.is_empty() {
            return 0;
        }
        let mut n = 0;
        let first_c = (from >> CHUNK_BITS).max(self.base);
        let last_c = (to >> CHUNK_BITS).min(self.base + self.chunks.len() as u64 - 1);
        let mut c = first_c;
        while c <= last_c {
            if let Some(ch) = self.chunks[(c - self.base) as usize].as_deref() {
                let lo = c << CHUNK_BITS;
                let hi = lo + CHUNK - 1;
                if from <= lo && hi <= to {
                    n += ch.live as u64;
                } else {
                    for s in lo.max(from)..=hi.min(to) {
                        n += ch.slots[(s & (CHUNK - 1)) as usize].live() as u64;
                    }
                }
            }
            c += 1;
        }
        n
    }
}

/// FxHash: subjects are short and trusted-ish (they passed the server's validation), and
/// this map is hit on every append, so a fast hasher matters more than DoS resistance.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut h = self.0;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let v = u64::from_le_bytes(c.try_into().unwrap());
            h = (h.rotate_left(5) ^ v).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            h = (h.rotate_left(5) ^ b as u64).wrapping_mul(K);
        }
        self.0 = h;
    }
    fn write_u8(&mut self, i: u8) {
        self.write(&[i]);
    }
    fn write_usize(&mut self, i: usize) {
        self.write(&i.to_le_bytes());
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;

/// Per-subject totals. `first`/`last` are bounds maintained lazily: `first` is never above
/// the subject's real first sequence and `last` never below its real last; a removal at
/// either end just moves the bound by one, and the exact value is found (and cached) on
/// demand. Discard-old on a stream with many interleaved subjects would otherwise scan
/// forward on every append.
pub(crate) struct SubjInfo {
    pub subject: Bytes,
    pub count: u64,
    first: Cell<u64>,
    last: Cell<u64>,
}

#[derive(Default)]
pub(crate) struct Subjects {
    map: HashMap<Bytes, u32, FxBuild>,
    infos: Vec<SubjInfo>,
    free: Vec<u32>,
}

impl Subjects {
    pub fn id(&self, subject: &[u8]) -> Option<u32> {
        self.map.get(subject).copied()
    }
    pub fn info(&self, id: u32) -> &SubjInfo {
        &self.infos[id as usize]
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// Live subject ids with their info.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &SubjInfo)> {
        self.infos
            .iter()
            .enumerate()
            .filter(|(_, i)| i.count > 0)
            .map(|(id, i)| (id as u32, i))
    }
    fn add(&mut self, subject: &[u8], seq: u64) -> u32 {
        if let Some(&id) = self.map.get(subject) {
            let i = &mut self.infos[id as usize];
            i.count += 1;
            // Appends only ever raise `last`; recovery may insert below the current range.
            if seq > i.last.get() {
                i.last.set(seq);
            }
            if seq < i.first.get() {
                i.first.set(seq);
            }
            return id;
        }
        let subject = Bytes::copy_from_slice(subject);
        let info = SubjInfo {
            subject: subject.clone(),
            count: 1,
            first: Cell::new(seq),
            last: Cell::new(seq),
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.infos[id as usize] = info;
                id
            }
            None => {
                self.infos.push(info);
                (self.infos.len() - 1) as u32
            }
        };
        self.map.insert(subject, id);
        id
    }
    fn remove(&mut self, id: u32, seq: u64) {
        let i = &mut self.infos[id as usize];
        i.count -= 1;
        if i.count == 0 {
            self.map.remove(&i.subject);
            i.subject = Bytes::new();
            self.free.push(id);
            return;
        }
        if seq == i.first.get() {
            i.first.set(seq + 1);
        }
        if seq == i.last.get() {
            i.last.set(seq - 1);
        }
    }
    fn clear(&mut self) {
        *self = Subjects::default();
    }
}

/// Subjects selected by a filter, as a dense membership table over subject ids.
enum Sel {
    All,
    One(u32),
    Many(Vec<bool>, Vec<u32>),
    None,
}

impl Sel {
    fn has(&self, id: u32) -> bool {
        match self {
            Sel::All => true,
            Sel::One(x) => *x == id,
            Sel::Many(m, _) => m[id as usize],
            Sel::None => false,
        }
    }
}

/// Stream bookkeeping shared by both stores. After each mutating call, `removed` holds the
/// messages it took away (seq, timestamp, payload) and `reset` is set when everything was dropped
/// wholesale; the file store turns these into tombstones and segment deletions, the memory
/// store just clears them.
pub(crate) struct Core<P> {
    pub slots: Slots<P>,
    pub subjects: Subjects,
    pub msgs: u64,
    pub bytes: u64,
    pub first_seq: u64,
    pub first_ts: i64,
    pub last_seq: u64,
    pub last_ts: i64,
    pub limits: Limits,
    pub removed: Vec<(u64, i64, P)>,
    pub reset: bool,
    /// Sequences max_age must not expire (`Nats-TTL: never`); kept by the server.
    pub age_exempt: std::collections::BTreeSet<u64>,
}

impl<P: Payload> Core<P> {
    pub fn new(limits: Limits) -> Self {
        Core {
            slots: Slots::new(),
            subjects: Subjects::default(),
            msgs: 0,
            bytes: 0,
            first_seq: 0,
            first_ts: 0,
            last_seq: 0,
            last_ts: 0,
            limits,
            removed: Vec::new(),
            reset: false,
            age_exempt: Default::default(),
        }
    }

    fn size_of(&self, s: &Slot<P>) -> u64 {
        s.p.acct_size(self.subjects.info(s.subj).subject.len())
    }

    /// Exact first sequence of a live subject (resolving the lazy bound).
    pub fn subj_first(&self, id: u32) -> u64 {
        let i = self.subjects.info(id);
        let hint = i.first.get();
        if i.count == 1 && self.slots.get(i.last.get()).is_some_and(|s| s.subj == id) {
            i.first.set(i.last.get());
            return i.last.get();
        }
        if self.slots.get(hint).is_some_and(|s| s.subj == id) {
            return hint;
        }
        let f = self
            .slots
            .iter(hint, i.last.get())
            .find(|(_, s)| s.subj == id)
            .map(|(q, _)| q)
            .expect("subject index out of step with slots");
        i.first.set(f);
        f
    }

    /// Exact last sequence of a live subject.
    pub fn subj_last(&self, id: u32) -> u64 {
        let i = self.subjects.info(id);
        let hint = i.last.get();
        if self.slots.get(hint).is_some_and(|s| s.subj == id) {
            return hint;
        }
        let mut seq = hint;
        let lo = i.first.get();
        // Walk back chunk-wise; `prev_live` skips freed chunks.
        loop {
            let q = self
                .slots
                .prev_live(lo, seq)
                .expect("subject index out of step with slots");
            if self.slots.get(q).unwrap().subj == id {
                i.last.set(q);
                return q;
            }
            seq = q - 1;
        }
    }

    /// Refusals that happen before anything is written: size and discard-new limits.
    pub fn check(&self, subject: &[u8], hdr: usize, data: usize, size: u64) -> crate::Result<()> {
        let l = &self.limits;
        if l.max_msg_size > 0 && (hdr + data) as u64 > l.max_msg_size as u64 {
            return Err(StoreError::MsgTooLarge);
        }
        if l.discard != Discard::New {
            return Ok(());
        }
        let id = self.subjects.id(subject);
        let at_subject_limit = l.max_msgs_per_subject > 0
            && id.is_some_and(|id| self.subjects.info(id).count >= l.max_msgs_per_subject as u64);
        if at_subject_limit && l.discard_new_per_subject {
            return Err(StoreError::MaxMsgsPerSubject);
        }
        // At the per-subject limit the append replaces that subject's oldest message, so
        // the totals do not grow (reference behaviour).
        if l.max_msgs > 0 && self.msgs >= l.max_msgs as u64 && !at_subject_limit {
            return Err(StoreError::MaxMsgs);
        }
        if l.max_bytes > 0 && self.bytes + size > l.max_bytes as u64 {
            if !at_subject_limit {
                return Err(StoreError::MaxBytes);
            }
            let first = self.subj_first(id.unwrap());
            if self.size_of(self.slots.get(first).unwrap()) < size {
                return Err(StoreError::MaxBytes);
            }
        }
        Ok(())
    }

    /// Appends at `seq` (normally `last_seq + 1`), without applying limits.
    pub fn insert(&mut self, seq: u64, subject: &[u8], ts: i64, p: P) {
        let id = self.subjects.add(subject, seq);
        let size = p.acct_size(subject.len());
        let t = ts as u64;
        self.slots.insert(
            seq,
            Slot {
                subj: id,
                ts: [t as u32, (t >> 32) as u32],
                p,
            },
        );
        if self.msgs == 0 || seq < self.first_seq {
            self.first_seq = seq;
            self.first_ts = ts;
        }
        self.msgs += 1;
        self.bytes += size;
        if seq >= self.last_seq {
            self.last_seq = seq;
            self.last_ts = ts;
        }
    }

    /// Appends with the next sequence and applies the limits (after [`check`]).
    pub fn append(&mut self, subject: &[u8], ts: i64, p: P) -> u64 {
        let seq = self.last_seq + 1;
        self.insert(seq, subject, ts, p);
        let l = &self.limits;
        if l.max_msgs_per_subject > 0 {
            let max = l.max_msgs_per_subject as u64;
            let id = self.subjects.id(subject).unwrap();
            while self.subjects.info(id).count > max {
                let f = self.subj_first(id);
                self.remove(f);
            }
        }
        self.enforce_totals();
        seq
    }

    /// Discard-old enforcement of max_msgs and max_bytes.
    fn enforce_totals(&mut self) {
        let l = &self.limits;
        if l.discard != Discard::Old {
            return;
        }
        let (mm, mb) = (l.max_msgs, l.max_bytes);
        while (mm > 0 && self.msgs > mm as u64) || (mb > 0 && self.bytes > mb as u64) {
            let f = self.first_seq;
            if !self.remove(f) {
                break;
            }
        }
    }

    /// Removes one live message, recording it in `removed`.
    pub fn remove(&mut self, seq: u64) -> bool {
        let Some(slot) = self.slots.take(seq) else {
            return false;
        };
        let size = self.size_of(&slot);
        if !self.age_exempt.is_empty() {
            self.age_exempt.remove(&seq);
        }
        self.subjects.remove(slot.subj, seq);
        self.msgs -= 1;
        self.bytes = self.bytes.saturating_sub(size);
        if seq == self.first_seq {
            self.advance_first(seq + 1);
        }
        self.removed.push((seq, slot.ts(), slot.p));
        true
    }

    /// Moves `first_seq` to the first live sequence at or after `from`.
    fn advance_first(&mut self, from: u64) {
        match self.slots.next_live(from, self.last_seq) {
            Some(s) => {
                self.first_seq = s;
                self.first_ts = self.slots.get(s).unwrap().ts();
            }
            None => {
                self.first_seq = self.last_seq + 1;
                self.first_ts = 0;
            }
        }
    }

    /// Drops everything; the next message gets `next_seq`.
    fn reset_to(&mut self, next_seq: u64) -> u64 {
        let n = self.msgs;
        self.slots.clear();
        self.subjects.clear();
        self.age_exempt.clear();
        self.msgs = 0;
        self.bytes = 0;
        self.first_seq = next_seq;
        self.first_ts = 0;
        self.last_seq = next_seq - 1;
        self.reset = true;
        n
    }

    /// STREAM.PURGE, following the reference's PurgeEx/Compact/Purge exactly.
    pub fn purge(&mut self, opts: &Purge) -> u64 {
        let seq = opts.seq.unwrap_or(0);
        let keep = opts.keep.unwrap_or(0);
        // "Purge below 1" is a no-op.
        if seq == 1 {
            return 0;
        }
        let filter = opts.filter.as_deref().unwrap_or("");
        if is_all(filter) {
            if keep == 0 && seq == 0 {
                let next = self.last_seq + 1;
                return self.reset_to(next);
            }
            if seq > 1 {
                return self.compact(seq);
            }
        }
        let sel = self.select(filter);
        let Some((first, last, total)) = self.filtered_range(&sel) else {
            return 0;
        };
        let mut max = u64::MAX;
        if keep > 0 {
            if keep >= total {
                return 0;
            }
            max = total - keep;
        }
        let last = if seq >= 1 { seq - 1 } else { last };
        let victims: Vec<u64> = self
            .slots
            .iter(first, last)
            .filter(|(_, s)| sel.has(s.subj))
            .map(|(q, _)| q)
            .take(max as usize)
            .collect();
        for &v in &victims {
            self.remove(v);
        }
        victims.len() as u64
    }

    /// Removes everything below `seq`; past the end it resets so the next message is `seq`.
    fn compact(&mut self, seq: u64) -> u64 {
        if self.first_seq > seq {
            return 0;
        }
        if seq <= self.last_seq {
            let victims: Vec<u64> = self
                .slots
                .iter(self.first_seq, seq - 1)
                .map(|(q, _)| q)
                .collect();
            for &v in &victims {
                self.remove(v);
            }
            victims.len() as u64
        } else {
            self.reset_to(seq)
        }
    }

    /// Removes messages with `ts <= now - max_age` from the front.
    pub fn expire(&mut self, now: i64) -> (u64, Option<i64>) {
        let age = self.limits.max_age.as_nanos().min(i64::MAX as u128) as i64;
        if age == 0 {
            return (0, None);
        }
        let cutoff = now.saturating_sub(age);
        let mut n = 0;
        if self.age_exempt.is_empty() {
            while self.msgs > 0 && self.first_ts <= cutoff {
                let f = self.first_seq;
                self.remove(f);
                n += 1;
            }
            let next = (self.msgs > 0).then(|| self.first_ts.saturating_add(age));
            return (n, next);
        }
        // Exempt messages stay; expiry walks past them to the first one still young.
        let mut seq = self.first_seq;
        let mut next = None;
        while let Some(s) = self.slots.next_live(seq, self.last_seq) {
            let ts = self.slots.get(s).map_or(0, |x| x.ts());
            if ts > cutoff {
                next = Some(ts.saturating_add(age));
                break;
            }
            if !self.age_exempt.contains(&s) {
                self.remove(s);
                n += 1;
            }
            seq = s + 1;
        }
        (n, next)
    }

    /// Moves the sequence on so that the next message stored gets `next` (a mirror skipping
    /// what its origin no longer holds, a stream's `first_seq`). An empty store restarts at
    /// `next`; otherwise the skipped sequences count as deleted.
    pub fn skip_to(&mut self, next: u64) {
        if next <= self.last_seq + 1 {
            return;
        }
        if self.msgs == 0 {
            self.reset_to(next);
        } else {
            self.last_seq = next - 1;
        }
    }

    pub fn set_limits(&mut self, limits: Limits) {
        let old_per = self.limits.max_msgs_per_subject;
        self.limits = limits;
        self.enforce_totals();
        let per = self.limits.max_msgs_per_subject;
        if per > 0 && (old_per <= 0 || per < old_per) {
            let over: Vec<u32> = self
                .subjects
                .iter()
                .filter(|(_, i)| i.count > per as u64)
                .map(|(id, _)| id)
                .collect();
            for id in over {
                while self.subjects.info(id).count > per as u64 {
                    let f = self.subj_first(id);
                    self.remove(f);
                }
            }
        }
    }

    fn select(&self, filter: &str) -> Sel {
        if is_all(filter) {
            return Sel::All;
        }
        if !keel_protocol::subject::has_wildcard(filter.as_bytes()) {
            return match self.subjects.id(filter.as_bytes()) {
                Some(id) => Sel::One(id),
                None => Sel::None,
            };
        }
        let mut member = vec![false; self.subjects.infos.len()];
        let mut ids = Vec::new();
        for (id, i) in self.subjects.iter() {
            if filter_matches(filter, &i.subject) {
                member[id as usize] = true;
                ids.push(id);
            }
        }
        if ids.is_empty() {
            Sel::None
        } else {
            Sel::Many(member, ids)
        }
    }

    fn sel_ids<'a>(&'a self, sel: &'a Sel) -> Box<dyn Iterator<Item = u32> + 'a> {
        match sel {
            Sel::All => Box::new(self.subjects.iter().map(|(id, _)| id)),
            Sel::One(id) => Box::new(std::iter::once(*id)),
            Sel::Many(_, ids) => Box::new(ids.iter().copied()),
            Sel::None => Box::new(std::iter::empty()),
        }
    }

    /// (first, last, count) of the messages a selection covers.
    fn filtered_range(&self, sel: &Sel) -> Option<(u64, u64, u64)> {
        if let Sel::All = sel {
            return (self.msgs > 0).then_some((self.first_seq, self.last_seq, self.msgs));
        }
        let mut out: Option<(u64, u64, u64)> = None;
        for id in self.sel_ids(sel) {
            let (f, l, c) = (
                self.subj_first(id),
                self.subj_last(id),
                self.subjects.info(id).count,
            );
            out = Some(match out {
                None => (f, l, c),
                Some((a, b, n)) => (a.min(f), b.max(l), n + c),
            });
        }
        out
    }

    /// Sequence of the first message at or after `start` matching `filter`.
    pub fn find_next(&self, start: u64, filter: &str) -> Option<u64> {
        let start = start.max(self.first_seq);
        if self.msgs == 0 || start > self.last_seq {
            return None;
        }
        let sel = self.select(filter);
        match &sel {
            Sel::All => self.slots.next_live(start, self.last_seq),
            Sel::None => None,
            Sel::One(id) => {
                let (f, l) = (self.subj_first(*id), self.subj_last(*id));
                if start <= f {
                    Some(f)
                } else if start > l {
                    None
                } else {
                    self.slots
                        .iter(start, l)
                        .find(|(_, s)| s.subj == *id)
                        .map(|(q, _)| q)
                }
            }
            Sel::Many(_, ids) => {
                // Narrow the scan to the span the selected subjects can occupy.
                let mut lo = u64::MAX;
                let mut hi = 0;
                for &id in ids {
                    let l = self.subj_last(id);
                    if l >= start {
                        lo = lo.min(self.subj_first(id));
                        hi = hi.max(l);
                    }
                }
                if lo == u64::MAX {
                    return None;
                }
                self.slots
                    .iter(start.max(lo), hi)
                    .find(|(_, s)| sel.has(s.subj))
                    .map(|(q, _)| q)
            }
        }
    }

    /// Sequence of the newest message matching `filter`.
    pub fn find_last(&self, filter: &str) -> Option<u64> {
        if self.msgs == 0 {
            return None;
        }
        match self.select(filter) {
            Sel::All => self.slots.prev_live(self.first_seq, self.last_seq),
            Sel::None => None,
            Sel::One(id) => Some(self.subj_last(id)),
            Sel::Many(_, ids) => ids.iter().map(|&id| self.subj_last(id)).max(),
        }
    }

    pub fn last_seq_for_subject(&self, subject: &str) -> u64 {
        self.subjects
            .id(subject.as_bytes())
            .map_or(0, |id| self.subj_last(id))
    }

    pub fn num_pending(&self, start: u64, filter: &str, last_per_subject: bool) -> u64 {
        if self.msgs == 0 {
            return 0;
        }
        let start = start.max(self.first_seq);
        if start > self.last_seq {
            return 0;
        }
        let sel = self.select(filter);
        if last_per_subject {
            return self
                .sel_ids(&sel)
                .filter(|&id| self.subj_last(id) >= start)
                .count() as u64;
        }
        if let Sel::All = sel {
            let span = self.last_seq - self.first_seq + 1;
            if span == self.msgs {
                // No interior deletes: pure arithmetic.
                return self.last_seq - start + 1;
            }
            // Count the shorter side from per-chunk live counters.
            return if start - self.first_seq < self.last_seq - start {
                self.msgs - self.slots.count(self.first_seq, start - 1)
            } else {
                self.slots.count(start, self.last_seq)
            };
        }
        // Whole subjects on either side of `start` come from their counts; only subjects
        // straddling `start` need a scan, limited to their span.
        let mut total = 0;
        let mut straddle: Vec<u32> = Vec::new();
        let (mut lo, mut hi) = (u64::MAX, 0);
        for id in self.sel_ids(&sel) {
            let f = self.subj_first(id);
            if f >= start {
                total += self.subjects.info(id).count;
                continue;
            }
            let l = self.subj_last(id);
            if l < start {
                continue;
            }
            straddle.push(id);
            lo = lo.min(f);
            hi = hi.max(l);
        }
        if straddle.is_empty() {
            return total;
        }
        let one = straddle.len() == 1;
        let member = |id: u32| {
            if one {
                straddle[0] == id
            } else {
                sel.has(id) && straddle.contains(&id)
            }
        };
        // Scan the shorter side: [start, hi] counts pending directly, [lo, start) counts
        // what to subtract from the straddlers' totals.
        if start - lo < hi - start {
            let below = self
                .slots
                .iter(lo, start - 1)
                .filter(|(_, s)| member(s.subj))
                .count() as u64;
            let sum: u64 = straddle
                .iter()
                .map(|&id| self.subjects.info(id).count)
                .sum();
            total + sum - below
        } else {
            total
                + self
                    .slots
                    .iter(start, hi)
                    .filter(|(_, s)| member(s.subj))
                    .count() as u64
        }
    }

    pub fn subjects_map(&self, filter: &str) -> BTreeMap<String, u64> {
        self.sel_ids(&self.select(filter))
            .map(|id| {
                let i = self.subjects.info(id);
                (String::from_utf8_lossy(&i.subject).into_owned(), i.count)
            })
            .collect()
    }

    /// Removes every message above `after`; `after` becomes the last sequence (see
    /// [`crate::Store::truncate`]). Returns how many went.
    pub fn truncate(&mut self, after: u64) -> u64 {
        if after >= self.last_seq {
            return 0;
        }
        if self.msgs == 0 || after < self.first_seq {
            let n = self.reset_to(after + 1);
            self.last_ts = 0;
            return n;
        }
        let gone: Vec<u64> = self
            .slots
            .iter(after + 1, self.last_seq)
            .map(|(q, _)| q)
            .collect();
        for &q in gone.iter().rev() {
            self.remove(q);
        }
        self.last_seq = after;
        self.last_ts = self
            .slots
            .prev_live(self.first_seq, after)
            .and_then(|q| self.slots.get(q))
            .map_or(0, |s| s.ts());
        if self.msgs == 0 {
            self.first_seq = after + 1;
            self.first_ts = 0;
        }
        gone.len() as u64
    }

    /// Deleted sequences between first and last as inclusive ranges, without listing each.
    pub fn deleted_ranges(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if self.msgs == 0 {
            return out;
        }
        let mut next = self.first_seq;
        for (q, _) in self.slots.iter(self.first_seq, self.last_seq) {
            if q > next {
                out.push((next, q - 1));
            }
            next = q + 1;
        }
        if next <= self.last_seq {
            out.push((next, self.last_seq));
        }
        out
    }

    pub fn deleted(&self) -> Vec<u64> {
        let mut out = Vec::new();
        if self.msgs == 0 {
            return out;
        }
        let mut next = self.first_seq;
        for (q, _) in self.slots.iter(self.first_seq, self.last_seq) {
            out.extend(next..q);
            next = q + 1;
        }
        out.extend(next..=self.last_seq);
        out
    }

    pub fn state(&self) -> State {
        State {
            msgs: self.msgs,
            bytes: self.bytes,
            first_seq: self.first_seq,
            first_ts: self.first_ts,
            last_seq: self.last_seq,
            last_ts: self.last_ts,
            num_subjects: self.subjects.len() as u64,
            num_deleted: if self.msgs == 0 {
                0
            } else {
                self.last_seq - self.first_seq + 1 - self.msgs
            },
            lost: None,
        }
    }

    /// Subject bytes of a live slot.
    pub fn subject_of(&self, s: &Slot<P>) -> Bytes {
        self.subjects.info(s.subj).subject.clone()
    }
}
