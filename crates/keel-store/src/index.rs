//! The bookkeeping both stores share: the per-subject index, stream counters, limits, purge
//! and the read-side queries, over a sequence-indexed [`Table`] of messages. The memory
//! store's table ([`SlotTable`]) keeps whole messages in memory; the file store's keeps
//! per-segment summaries in memory and each message's entry on disk, loaded through a
//! bounded cache (`segtable`). Keeping one implementation of the semantics is what makes
//! the two stores agree on every one of them (limits, purge variants, first/last sequence
//! rules, pending counts).

use crate::{filter_matches, is_all, Discard, Limits, Purge, State, StoreError};
use bytes::Bytes;
use std::cell::Cell;
use std::collections::{BTreeMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

/// What the semantics need to know about one live message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Meta {
    /// Subject id (see [`Subjects`]).
    pub subj: u32,
    pub ts: i64,
    /// Reference byte accounting for the message.
    pub size: u64,
    pub hdr: bool,
}

/// Messages by sequence. Queries take `&self`; a table that loads from disk does so through
/// interior mutability.
pub(crate) trait Table {
    /// What the store keeps per message besides [`Meta`].
    type P;
    /// The stream's subjects (the table keeps them: reading entries back from disk needs
    /// to map subject names to ids).
    fn subjects(&self) -> &Subjects;
    fn subjects_mut(&mut self) -> &mut Subjects;
    fn get(&self, seq: u64) -> Option<Meta>;
    /// Adds a live message. Sequences arrive in increasing order, except that recovery may
    /// insert below what the table holds (never a sequence that is live).
    fn insert(&mut self, seq: u64, m: Meta, p: Self::P);
    fn take(&mut self, seq: u64) -> Option<(Meta, Self::P)>;
    /// Removes `seq`, whose meta the caller already knows (a tombstone carries it), without
    /// reading its entry where the table can tell liveness alone. True if it was live.
    fn kill(&mut self, seq: u64, _m: &Meta) -> bool {
        self.take(seq).is_some()
    }
    /// Drops every message and subject.
    fn clear(&mut self);
    /// First live sequence in `[from, to]`.
    fn next_live(&self, from: u64, to: u64) -> Option<u64>;
    /// Last live sequence in `[from, to]`.
    fn prev_live(&self, from: u64, to: u64) -> Option<u64>;
    /// Live messages in `[from, to]`.
    fn count(&self, from: u64, to: u64) -> u64;
    /// Visits the live messages in `[from, to]` whose subject `sel` selects, in order, while
    /// `f` returns true.
    fn scan(&self, from: u64, to: u64, sel: &Sel, f: &mut dyn FnMut(u64, &Meta) -> bool);
    /// Last live message in `[from, to]` whose subject `sel` selects.
    fn prev_sel(&self, from: u64, to: u64, sel: &Sel) -> Option<u64>;
    /// Calls `f(a, b)` for each maximal run `a..=b` of live sequences in `[from, to]`, in
    /// order.
    fn live_runs(&self, from: u64, to: u64, f: &mut dyn FnMut(u64, u64)) {
        let mut runs = Runs::new(f);
        self.scan(from, to, &Sel::All, &mut |q, _| {
            runs.add(q, q);
            true
        });
        runs.finish();
    }
    /// Live messages in `[from, to]` whose subject `sel` selects.
    fn count_sel(&self, from: u64, to: u64, sel: &Sel) -> u64 {
        let mut n = 0;
        self.scan(from, to, sel, &mut |_, _| {
            n += 1;
            true
        });
        n
    }
}

/// Joins runs of sequences given in order into maximal runs, for [`Table::live_runs`].
pub(crate) struct Runs<'a> {
    run: Option<(u64, u64)>,
    f: &'a mut dyn FnMut(u64, u64),
}

impl<'a> Runs<'a> {
    pub fn new(f: &'a mut dyn FnMut(u64, u64)) -> Self {
        Runs { run: None, f }
    }

    /// Adds `a..=b` (after every run added so far).
    pub fn add(&mut self, a: u64, b: u64) {
        match &mut self.run {
            Some((_, e)) if *e + 1 == a => *e = b,
            _ => {
                if let Some((x, y)) = self.run.replace((a, b)) {
                    (self.f)(x, y);
                }
            }
        }
    }

    pub fn finish(self) {
        if let Some((a, b)) = self.run {
            (self.f)(a, b);
        }
    }
}

// ---- the memory store's table ---------------------------------------------------------

const NO_SUBJ: u32 = u32::MAX;

/// One sequence. `subj == NO_SUBJ` means the sequence is not live.
#[derive(Clone)]
pub(crate) struct Slot<P> {
    subj: u32,
    hdr: bool,
    ts: i64,
    size: u64,
    pub p: P,
}

impl<P: Default> Default for Slot<P> {
    fn default() -> Self {
        Slot {
            subj: NO_SUBJ,
            hdr: false,
            ts: 0,
            size: 0,
            p: P::default(),
        }
    }
}

impl<P> Slot<P> {
    fn live(&self) -> bool {
        self.subj != NO_SUBJ
    }
    fn meta(&self) -> Meta {
        Meta {
            subj: self.subj,
            ts: self.ts,
            size: self.size,
            hdr: self.hdr,
        }
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
pub(crate) struct SlotTable<P> {
    base: u64,
    chunks: VecDeque<Option<Box<Chunk<P>>>>,
    subjects: Subjects,
}

impl<P: Default> SlotTable<P> {
    pub fn new() -> Self {
        SlotTable {
            base: 0,
            chunks: VecDeque::new(),
            subjects: Subjects::default(),
        }
    }

    fn chunk(&self, seq: u64) -> Option<&Chunk<P>> {
        let c = seq >> CHUNK_BITS;
        if c < self.base {
            return None;
        }
        self.chunks.get((c - self.base) as usize)?.as_deref()
    }

    pub fn slot(&self, seq: u64) -> Option<&Slot<P>> {
        let s = &self.chunk(seq)?.slots[(seq & (CHUNK - 1)) as usize];
        s.live().then_some(s)
    }

    /// Live slots in `[from, to]`, in order, skipping freed chunks without visiting them.
    fn iter(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, &Slot<P>)> + '_ {
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
}

impl<P: Default> Table for SlotTable<P> {
    type P = P;

    fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    fn subjects_mut(&mut self) -> &mut Subjects {
        &mut self.subjects
    }

    fn get(&self, seq: u64) -> Option<Meta> {
        self.slot(seq).map(|s| s.meta())
    }

    fn insert(&mut self, seq: u64, m: Meta, p: P) {
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
        *s = Slot {
            subj: m.subj,
            hdr: m.hdr,
            ts: m.ts,
            size: m.size,
            p,
        };
        ch.live += 1;
    }

    fn take(&mut self, seq: u64) -> Option<(Meta, P)> {
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
        Some((out.meta(), out.p))
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.base = 0;
        self.subjects.clear();
    }

    fn next_live(&self, from: u64, to: u64) -> Option<u64> {
        self.iter(from, to).next().map(|(s, _)| s)
    }

    fn prev_live(&self, from: u64, to: u64) -> Option<u64> {
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
                    if s <= lo {
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

    fn count(&self, from: u64, to: u64) -> u64 {
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

    fn scan(&self, from: u64, to: u64, sel: &Sel, f: &mut dyn FnMut(u64, &Meta) -> bool) {
        for (q, s) in self.iter(from, to) {
            if sel.has(s.subj) && !f(q, &s.meta()) {
                return;
            }
        }
    }

    fn live_runs(&self, from: u64, to: u64, f: &mut dyn FnMut(u64, u64)) {
        let mut runs = Runs::new(f);
        let from = from.max(self.base << CHUNK_BITS);
        let end_chunk = self.base + self.chunks.len() as u64;
        for c in (from >> CHUNK_BITS)..end_chunk {
            let (lo, hi) = (
                (c << CHUNK_BITS).max(from),
                (((c + 1) << CHUNK_BITS) - 1).min(to),
            );
            if lo > to {
                break;
            }
            let Some(ch) = self.chunks[(c - self.base) as usize].as_deref() else {
                continue;
            };
            // A full chunk is one run: a snapshot of a memory stream visits its chunks,
            // not its messages.
            if ch.live as u64 == CHUNK {
                runs.add(lo, hi);
                continue;
            }
            for q in lo..=hi {
                if ch.slots[(q & (CHUNK - 1)) as usize].live() {
                    runs.add(q, q);
                }
            }
        }
        runs.finish();
    }

    fn prev_sel(&self, from: u64, to: u64, sel: &Sel) -> Option<u64> {
        let mut to = to;
        loop {
            let q = self.prev_live(from, to)?;
            if sel.has(self.slot(q)?.subj) {
                return Some(q);
            }
            if q == 0 {
                return None;
            }
            to = q - 1;
        }
    }
}

// ---- subjects -------------------------------------------------------------------------

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

fn hash_subject(s: &[u8]) -> u64 {
    let mut h = FxBuild::default().build_hasher();
    h.write(s);
    // Spread the length in too: FxHash of a prefix and its extension can collide cheaply.
    h.write_usize(s.len());
    h.finish()
}

/// Per-subject totals. `first`/`last` are bounds maintained lazily: `first` is never above
/// the subject's real first sequence and `last` never below its real last; a removal at
/// either end just moves the bound by one, and the exact value is found (and cached) on
/// demand. Discard-old on a stream with many interleaved subjects would otherwise scan
/// forward on every append. The name lives in the shared arena (no allocation per subject).
pub(crate) struct SubjInfo {
    first: Cell<u64>,
    last: Cell<u64>,
    pub count: u64,
    off: u32,
    len: u32,
}

/// The subjects of a stream: an arena of names, one 32-byte record per subject and a hash
/// table of ids, so a bucket with millions of keys costs about 40 bytes per key plus the
/// key itself.
#[derive(Default)]
pub(crate) struct Subjects {
    names: Vec<u8>,
    /// Bytes of `names` that belong to freed subjects.
    garbage: usize,
    infos: Vec<SubjInfo>,
    table: hashbrown::HashTable<u32>,
    free: Vec<u32>,
}

impl Subjects {
    fn name_of<'a>(names: &'a [u8], i: &SubjInfo) -> &'a [u8] {
        &names[i.off as usize..i.off as usize + i.len as usize]
    }

    pub fn id(&self, subject: &[u8]) -> Option<u32> {
        let h = hash_subject(subject);
        self.table
            .find(h, |&id| {
                Self::name_of(&self.names, &self.infos[id as usize]) == subject
            })
            .copied()
    }
    pub fn info(&self, id: u32) -> &SubjInfo {
        &self.infos[id as usize]
    }
    pub fn name(&self, id: u32) -> &[u8] {
        Self::name_of(&self.names, &self.infos[id as usize])
    }
    pub fn len(&self) -> usize {
        self.table.len()
    }
    /// One past the highest id handed out (for dense per-id tables).
    pub fn id_bound(&self) -> usize {
        self.infos.len()
    }
    /// Live subject ids with their info.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &SubjInfo)> {
        self.infos
            .iter()
            .enumerate()
            .filter(|(_, i)| i.count > 0)
            .map(|(id, i)| (id as u32, i))
    }

    /// Adds `n` messages of `subject` spanning `first..=last`; returns its id.
    pub fn add_n(&mut self, subject: &[u8], n: u64, first: u64, last: u64) -> u32 {
        if let Some(id) = self.id(subject) {
            let i = &mut self.infos[id as usize];
            if i.count == 0 {
                i.first.set(first);
                i.last.set(last);
            } else {
                // Appends only ever raise `last`; recovery may insert below the range.
                if last > i.last.get() {
                    i.last.set(last);
                }
                if first < i.first.get() {
                    i.first.set(first);
                }
            }
            i.count += n;
            return id;
        }
        self.maybe_compact_names();
        let off = self.names.len() as u32;
        self.names.extend_from_slice(subject);
        let info = SubjInfo {
            first: Cell::new(first),
            last: Cell::new(last),
            count: n,
            off,
            len: subject.len() as u32,
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
        let h = hash_subject(subject);
        let (names, infos) = (&self.names, &self.infos);
        self.table.insert_unique(h, id, |&x| {
            hash_subject(Self::name_of(names, &infos[x as usize]))
        });
        id
    }

    pub fn add(&mut self, subject: &[u8], seq: u64) -> u32 {
        self.add_n(subject, 1, seq, seq)
    }

    /// One message of `id` at `seq` went.
    pub fn remove(&mut self, id: u32, seq: u64) {
        self.remove_n(id, 1, seq, seq);
    }

    /// `n` messages of `id` within `lo..=hi` went.
    pub fn remove_n(&mut self, id: u32, n: u64, lo: u64, hi: u64) {
        let i = &mut self.infos[id as usize];
        i.count = i.count.saturating_sub(n);
        if i.count == 0 {
            let h = hash_subject(Self::name_of(&self.names, i));
            if let Ok(e) = self.table.find_entry(h, |&x| x == id) {
                e.remove();
            }
            let i = &mut self.infos[id as usize];
            self.garbage += i.len as usize;
            i.len = 0;
            self.free.push(id);
            return;
        }
        if lo <= i.first.get() {
            i.first.set(hi + 1);
        }
        if hi >= i.last.get() && lo > 0 {
            i.last.set(lo - 1);
        }
    }

    /// Rewrites the name arena once most of it belongs to freed subjects (a KV bucket
    /// whose keys come and go).
    fn maybe_compact_names(&mut self) {
        if self.garbage < 1 << 20 || self.garbage * 2 < self.names.len() {
            return;
        }
        let mut names = Vec::with_capacity(self.names.len() - self.garbage);
        for i in &mut self.infos {
            if i.count > 0 {
                let off = names.len() as u32;
                names.extend_from_slice(Self::name_of(&self.names, i));
                i.off = off;
            } else {
                i.off = 0;
            }
        }
        self.names = names;
        self.garbage = 0;
    }

    pub fn clear(&mut self) {
        *self = Subjects::default();
    }

    /// Approximate heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.names.capacity()
            + self.infos.capacity() * std::mem::size_of::<SubjInfo>()
            + self.table.capacity() * 5
            + self.free.capacity() * 4
    }
}

/// Subjects selected by a filter, as a dense membership table over subject ids.
pub(crate) enum Sel {
    All,
    One(u32),
    Many(Vec<bool>, Vec<u32>),
    None,
}

impl Sel {
    pub fn has(&self, id: u32) -> bool {
        match self {
            Sel::All => true,
            Sel::One(x) => *x == id,
            Sel::Many(m, _) => m.get(id as usize).copied().unwrap_or(false),
            Sel::None => false,
        }
    }
}

/// A message a core operation removed: what the file store needs to record it.
pub(crate) struct Removed<P> {
    pub seq: u64,
    pub meta: Meta,
    pub subject: Bytes,
    pub p: P,
}

/// Stream bookkeeping shared by both stores. After each mutating call, `removed` holds the
/// messages it took away and `reset` is set when everything was dropped wholesale; the
/// file store turns these into tombstones and segment deletions, the memory store just
/// clears them. Removals below the new first sequence are only recorded when `record_all`
/// is set (the file store's marker covers them).
pub(crate) struct Core<T: Table> {
    pub slots: T,
    pub msgs: u64,
    pub bytes: u64,
    pub first_seq: u64,
    pub first_ts: i64,
    pub last_seq: u64,
    pub last_ts: i64,
    pub limits: Limits,
    pub removed: Vec<Removed<T::P>>,
    pub reset: bool,
    /// Sequences max_age must not expire (`Nats-TTL: never`); kept by the server.
    pub age_exempt: std::collections::BTreeSet<u64>,
    /// A wholesale drop records every message in `removed` too (the memory store keeps
    /// them to roll back with).
    pub record_resets: bool,
}

impl<T: Table> Core<T> {
    pub fn new(limits: Limits, slots: T) -> Self {
        Core {
            slots,
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
            record_resets: false,
        }
    }

    pub fn subjects(&self) -> &Subjects {
        self.slots.subjects()
    }

    fn is_subj(&self, seq: u64, id: u32) -> bool {
        self.slots.get(seq).is_some_and(|m| m.subj == id)
    }

    /// Exact first sequence of a live subject (resolving the lazy bound). Falls back to the
    /// bound if the table lost the subject's messages (damage found while reading).
    pub fn subj_first(&self, id: u32) -> u64 {
        let i = self.slots.subjects().info(id);
        let hint = i.first.get();
        if i.count == 1 && self.is_subj(i.last.get(), id) {
            i.first.set(i.last.get());
            return i.last.get();
        }
        if self.is_subj(hint, id) {
            return hint;
        }
        let mut found = None;
        self.slots
            .scan(hint, i.last.get(), &Sel::One(id), &mut |q, _| {
                found = Some(q);
                false
            });
        match found {
            Some(f) => {
                i.first.set(f);
                f
            }
            None => hint,
        }
    }

    /// Exact last sequence of a live subject.
    pub fn subj_last(&self, id: u32) -> u64 {
        let i = self.slots.subjects().info(id);
        let hint = i.last.get();
        if self.is_subj(hint, id) {
            return hint;
        }
        match self.slots.prev_sel(i.first.get(), hint, &Sel::One(id)) {
            Some(q) => {
                i.last.set(q);
                q
            }
            None => hint,
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
        let id = self.slots.subjects().id(subject);
        let at_subject_limit = l.max_msgs_per_subject > 0
            && id.is_some_and(|id| {
                self.slots.subjects().info(id).count >= l.max_msgs_per_subject as u64
            });
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
            if self.slots.get(first).map_or(0, |m| m.size) < size {
                return Err(StoreError::MaxBytes);
            }
        }
        Ok(())
    }

    /// Appends at `seq` (normally `last_seq + 1`), without applying limits.
    pub fn insert(&mut self, seq: u64, subject: &[u8], ts: i64, size: u64, hdr: bool, p: T::P) {
        let id = self.slots.subjects_mut().add(subject, seq);
        self.slots.insert(
            seq,
            Meta {
                subj: id,
                ts,
                size,
                hdr,
            },
            p,
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
    pub fn append(&mut self, subject: &[u8], ts: i64, size: u64, hdr: bool, p: T::P) -> u64 {
        let seq = self.last_seq + 1;
        self.insert(seq, subject, ts, size, hdr, p);
        let l = &self.limits;
        if l.max_msgs_per_subject > 0 {
            let max = l.max_msgs_per_subject as u64;
            if let Some(id) = self.slots.subjects().id(subject) {
                while self.slots.subjects().info(id).count > max {
                    let f = self.subj_first(id);
                    if !self.remove(f) {
                        break;
                    }
                }
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
        let Some((m, p)) = self.slots.take(seq) else {
            return false;
        };
        if !self.age_exempt.is_empty() {
            self.age_exempt.remove(&seq);
        }
        let subject = Bytes::copy_from_slice(self.slots.subjects().name(m.subj));
        self.account_removed(seq, &m);
        self.removed.push(Removed {
            seq,
            meta: m,
            subject,
            p,
        });
        true
    }

    /// Counters after the table dropped `seq` (already taken).
    pub fn account_removed(&mut self, seq: u64, m: &Meta) {
        self.slots.subjects_mut().remove(m.subj, seq);
        self.msgs = self.msgs.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(m.size);
        if seq == self.first_seq {
            self.advance_first(seq + 1);
        }
    }

    /// Moves `first_seq` to the first live sequence at or after `from`.
    pub fn advance_first(&mut self, from: u64) {
        match self.slots.next_live(from, self.last_seq) {
            Some(s) => {
                self.first_seq = s;
                self.first_ts = self.slots.get(s).map_or(0, |m| m.ts);
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
        if self.record_resets && self.msgs > 0 {
            for q in self.collect(self.first_seq, self.last_seq, &Sel::All, u64::MAX) {
                self.remove(q);
            }
        }
        self.slots.clear();
        self.age_exempt.clear();
        self.msgs = 0;
        self.bytes = 0;
        self.first_seq = next_seq;
        self.first_ts = 0;
        self.last_seq = next_seq - 1;
        self.reset = true;
        n
    }

    /// Live sequences in `[from, to]` that `sel` selects, at most `max`.
    fn collect(&self, from: u64, to: u64, sel: &Sel, max: u64) -> Vec<u64> {
        let mut v = Vec::new();
        if max == 0 {
            return v;
        }
        self.slots.scan(from, to, sel, &mut |q, _| {
            v.push(q);
            (v.len() as u64) < max
        });
        v
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
        let victims = self.collect(first, last, &sel, max);
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
            let victims = self.collect(self.first_seq, seq - 1, &Sel::All, u64::MAX);
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
                if !self.remove(f) {
                    break;
                }
                n += 1;
            }
            let next = (self.msgs > 0).then(|| self.first_ts.saturating_add(age));
            return (n, next);
        }
        // Exempt messages stay; expiry walks past them to the first one still young.
        let mut seq = self.first_seq;
        let mut next = None;
        while let Some(s) = self.slots.next_live(seq, self.last_seq) {
            let ts = self.slots.get(s).map_or(0, |m| m.ts);
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
                .slots
                .subjects()
                .iter()
                .filter(|(_, i)| i.count > per as u64)
                .map(|(id, _)| id)
                .collect();
            for id in over {
                while self.slots.subjects().info(id).count > per as u64 {
                    let f = self.subj_first(id);
                    if !self.remove(f) {
                        break;
                    }
                }
            }
        }
    }

    pub fn select(&self, filter: &str) -> Sel {
        if is_all(filter) {
            return Sel::All;
        }
        if !keel_protocol::subject::has_wildcard(filter.as_bytes()) {
            return match self.slots.subjects().id(filter.as_bytes()) {
                Some(id) => Sel::One(id),
                None => Sel::None,
            };
        }
        let mut member = vec![false; self.slots.subjects().id_bound()];
        let mut ids = Vec::new();
        for (id, _) in self.slots.subjects().iter() {
            if filter_matches(filter, self.slots.subjects().name(id)) {
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
            Sel::All => Box::new(self.slots.subjects().iter().map(|(id, _)| id)),
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
                self.slots.subjects().info(id).count,
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
        let (lo, hi) = match &sel {
            Sel::All => return self.slots.next_live(start, self.last_seq),
            Sel::None => return None,
            Sel::One(id) => {
                let (f, l) = (self.subj_first(*id), self.subj_last(*id));
                if start <= f && self.is_subj(f, *id) {
                    return Some(f);
                }
                if start > l {
                    return None;
                }
                (start.max(f), l)
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
                (start.max(lo), hi)
            }
        };
        let mut found = None;
        self.slots.scan(lo, hi, &sel, &mut |q, _| {
            found = Some(q);
            false
        });
        found
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
        self.slots
            .subjects()
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
            // Count the shorter side from the table's live counters.
            return if start - self.first_seq < self.last_seq - start {
                self.msgs - self.slots.count(self.first_seq, start - 1)
            } else {
                self.slots.count(start, self.last_seq)
            };
        }
        // Whole subjects on either side of `start` come from their counts; only subjects
        // straddling `start` need counting, limited to their span.
        let mut total = 0;
        let mut straddle: Vec<u32> = Vec::new();
        let (mut lo, mut hi) = (u64::MAX, 0);
        for id in self.sel_ids(&sel) {
            let f = self.subj_first(id);
            if f >= start {
                total += self.slots.subjects().info(id).count;
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
        let ssel = if straddle.len() == 1 {
            Sel::One(straddle[0])
        } else {
            let mut member = vec![false; self.slots.subjects().id_bound()];
            for &id in &straddle {
                member[id as usize] = true;
            }
            Sel::Many(member, straddle.clone())
        };
        // Count the shorter side: [start, hi] counts pending directly, [lo, start) counts
        // what to subtract from the straddlers' totals.
        if start - lo < hi - start {
            let below = self.slots.count_sel(lo, start - 1, &ssel);
            let sum: u64 = straddle
                .iter()
                .map(|&id| self.slots.subjects().info(id).count)
                .sum();
            total + sum.saturating_sub(below)
        } else {
            total + self.slots.count_sel(start, hi, &ssel)
        }
    }

    pub fn subjects_map(&self, filter: &str) -> BTreeMap<String, u64> {
        self.sel_ids(&self.select(filter))
            .map(|id| {
                (
                    String::from_utf8_lossy(self.slots.subjects().name(id)).into_owned(),
                    self.slots.subjects().info(id).count,
                )
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
        let mut gone: Vec<u64> = Vec::new();
        self.slots
            .scan(after + 1, self.last_seq, &Sel::All, &mut |q, _| {
                gone.push(q);
                true
            });
        for &q in gone.iter().rev() {
            self.remove(q);
        }
        self.last_seq = after;
        self.last_ts = self
            .slots
            .prev_live(self.first_seq, after)
            .and_then(|q| self.slots.get(q))
            .map_or(0, |m| m.ts);
        if self.msgs == 0 {
            self.first_seq = after + 1;
            self.first_ts = 0;
        }
        gone.len() as u64
    }

    /// Deleted sequences between first and last as inclusive ranges, without listing each
    /// (a snapshot's: found from the runs of live sequences, which a file store tells from
    /// its segments' summaries without reading their entries).
    pub fn deleted_ranges(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if self.msgs == 0 {
            return out;
        }
        let mut next = self.first_seq;
        self.slots
            .live_runs(self.first_seq, self.last_seq, &mut |a, b| {
                if a > next {
                    out.push((next, a - 1));
                }
                next = b + 1;
            });
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
        self.slots
            .scan(self.first_seq, self.last_seq, &Sel::All, &mut |q, _| {
                out.extend(next..q);
                next = q + 1;
                true
            });
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
            num_subjects: self.slots.subjects().len() as u64,
            num_deleted: if self.msgs == 0 {
                0
            } else {
                self.last_seq - self.first_seq + 1 - self.msgs
            },
            lost: None,
        }
    }
}
