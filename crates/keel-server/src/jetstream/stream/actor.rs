//! The stream's actor: its only writer. Publishes (from the ingest queue), sourced and
//! mirrored batches (from the sourced queue) and [`Command`]s (purge, message delete,
//! config update, first-sequence skip, retention removals, the maintenance tick) are taken
//! one at a time; each is decided by the [`Leader`], proposed to the [`Replicator`]
//! (which applies it), committed, and only then answered, acknowledged or made visible
//! (the committed watermark moves, republishes go out).
//!
//! The store's lock is held while a batch is applied and around the two halves of a sync,
//! never across an fsync, and no consumer's lock is taken while it is held (the consumer set
//! is read before or after).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use keel_protocol::subject;
use keel_store::{Purge, Store, StoreError};
use tokio::sync::{mpsc, oneshot};

use super::apply::Applied;
use super::config::{Retention, StorageType, StreamConfig};
use super::decide::{self, store_error, Intake, Leader, PubResult};
use super::entry::StreamEntry;
use super::read::{blocking, WriteHandle};
use super::replicator::Replicator;
use super::{Settings, Stream, StreamMeta};
use crate::client::InMsg;
use crate::jetstream::api::{ApiError, ErrorKind};
use crate::jetstream::registry::JsUsage;
use crate::jetstream::republish;
use crate::jetstream::sourcing::{SourcedBatch, Taken};
use crate::router::{Outgoing, Router};
use crate::server::Server;

/// Most messages and bytes in one group-commit batch.
const BATCH_MSGS: usize = 4096;
const BATCH_BYTES: usize = 8 * 1024 * 1024;
/// Commands waiting for the actor (each is small; senders wait for room).
pub const COMMAND_QUEUE: usize = 64;
/// Messages read per step when a consumer left an interest stream.
const RELEASE_STEP: usize = 1024;
/// How many messages a new leader looks at for removals its predecessor did not commit.
const LEAD_SCAN: usize = 64 * 1024;

/// What the actor is asked to do besides storing publishes. Replies come once the change
/// is committed.
pub enum Command {
    /// STREAM.PURGE: how many messages went.
    Purge {
        req: Purge,
        reply: oneshot::Sender<Result<u64, ApiError>>,
    },
    /// STREAM.MSG.DELETE.
    DeleteMsg {
        seq: u64,
        erase: bool,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    /// STREAM.UPDATE with a checked config: written to the meta file first, then live.
    Update {
        cfg: Box<StreamConfig>,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    /// A new stream's `first_seq`.
    SkipTo {
        next: u64,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    /// A consumer is done with these sequences (acked, terminated, skipped by a reset):
    /// interest and work-queue streams drop what no consumer still needs.
    Retention { seqs: Vec<u64> },
    /// A consumer left an interest stream: drop what no remaining consumer needs.
    ReleaseInterest,
    /// This replica leads now and its consumers are loaded (`retention_after_lead`).
    RetentionAfterLead,
    /// The maintenance tick: expiry, the sync interval, compaction, saving source positions.
    Tick,
    /// A rebuilt follower asked this leader to append an empty batch (`raft::Rpc::Nudge`):
    /// from the actor, so that it never lands between a batch applied early and its commit.
    Nudge,
    /// A compaction's rewrite finished (off the actor, on a blocking thread): put it in
    /// place.
    Compacted {
        segment: u32,
        done: Box<keel_store::CompactDone>,
    },
    /// STREAM.DELETE (its consumers are gone): destroy the store and end.
    Delete { reply: oneshot::Sender<()> },
    /// A replicated stream's server became its ready leader: the config its state machine
    /// applied goes live here, and the leader's memory (dedup window, TTLs) is rebuilt
    /// from the store before anything is decided.
    Lead { reply: oneshot::Sender<bool> },
    /// A durable consumer's change for a replicated stream's group; the reply (if asked
    /// for) once a quorum has it.
    Replicate {
        entry: crate::jetstream::raft::stream::ConsumerEntry,
        reply: Option<oneshot::Sender<Result<(), ApiError>>>,
    },
    /// The publishes queued now are handled (stored, or refused once this server no
    /// longer leads) and answered before the reply: a server handing its leaderships over
    /// before it stops answers the ones it took instead of leaving them to time out.
    Drain { reply: oneshot::Sender<()> },
    /// Unit tests: the actor panics, as a bug would make it.
    #[cfg(test)]
    Panic,
}

/// The actor: its store (the write handle) and everything else (the [`Core`]), apart so
/// that the core decides and proposes with the store locked.
pub struct Actor<R: Replicator> {
    store: WriteHandle,
    core: Core<R>,
}

/// The actor's state besides its store.
pub struct Core<R: Replicator> {
    stream: Arc<Stream>,
    server: Arc<Server>,
    pub(crate) cfg: Arc<StreamConfig>,
    pub(crate) leader: Leader,
    replicator: R,
    router: Router,
    settings: Settings,
    last_sync: Instant,
    /// When compaction last looked for a segment to rewrite; whether one is being
    /// rewritten now; whether the last one gave space back (look again at once).
    last_compact: Instant,
    compacting: bool,
    compact_busy: bool,
    /// The last failed commit's outcome, when it may still commit.
    uncertain: Option<super::replicator::Uncertain>,
}

/// How often an idle file stream looks for a segment worth compacting.
const COMPACT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl<R: Replicator> Actor<R> {
    pub fn new(
        stream: Arc<Stream>,
        server: Arc<Server>,
        store: WriteHandle,
        cfg: Arc<StreamConfig>,
        leader: Leader,
        replicator: R,
        settings: &Settings,
    ) -> Actor<R> {
        let router = Router::new(stream.account().clone(), stream.created as u64);
        Actor {
            store,
            core: Core {
                stream,
                server,
                cfg,
                leader,
                replicator,
                router,
                settings: settings.clone(),
                last_sync: Instant::now(),
                last_compact: Instant::now(),
                compacting: false,
                compact_busy: false,
                uncertain: None,
            },
        }
    }
}

impl<R: Replicator> Core<R> {
    fn log(&self) -> &crate::log::Log {
        self.stream.handle_log()
    }

    /// How many bytes the stream may hold under the server-wide memory or file store
    /// limit (every account's streams count) and its account's (the account's streams
    /// count), or None when unlimited.
    fn budget(&self) -> Option<u64> {
        let storage = self.stream.storage;
        let mine = self.stream.bytes.load(std::sync::atomic::Ordering::Relaxed);
        let left = |limit: i64, usage: &JsUsage| {
            (limit >= 0).then(|| {
                let others = usage.bytes(storage).saturating_sub(mine);
                (limit as u64).saturating_sub(others)
            })
        };
        let server_limit = match storage {
            StorageType::Memory => self.settings.max_memory,
            StorageType::File => self.settings.max_store,
        };
        let server = left(server_limit, &self.settings.server_usage);
        let account = left(
            crate::jetstream::account_limit(&self.settings.account, storage),
            &self.settings.usage,
        );
        match (server, account) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Interest retention keeps a message only while some consumer wants its subject: the
    /// consumers' filters (read before the store is locked).
    fn interest(&self) -> Option<Vec<Vec<String>>> {
        (self.cfg.retention == Retention::Interest).then(|| {
            self.stream
                .consumers
                .views()
                .iter()
                .map(|c| c.filters())
                .collect()
        })
    }

    /// Decides one message and proposes it (and, with interest retention and nobody
    /// wanting it, its removal).
    #[allow(clippy::too_many_arguments)]
    fn publish_one(
        &mut self,
        store: &mut dyn Store,
        subject: &Bytes,
        hdr: Bytes,
        data: Bytes,
        intake: Intake,
        budget: Option<u64>,
        interest: Option<&[Vec<String>]>,
    ) -> PubResult {
        let (m, d) = match self
            .leader
            .decide(&self.cfg, store, subject, hdr, data, intake, budget)
        {
            Ok(x) => x,
            Err(r) => return r,
        };
        let entry = StreamEntry::Msg(m);
        if let Err(e) = self.replicator.propose(store, &entry) {
            self.leader.io_error |= matches!(e, StoreError::Io(_));
            return PubResult::Error(store_error(e));
        }
        let StreamEntry::Msg(m) = &entry else {
            unreachable!("a message entry")
        };
        self.leader.record(&self.cfg, m, &d);
        if let Some(filters) = interest {
            let wanted = filters.iter().any(|f| {
                f.is_empty() || f.iter().any(|p| subject::matches(p.as_bytes(), &m.subject))
            });
            if !wanted {
                let gone = StreamEntry::Remove {
                    seqs: vec![m.seq],
                    erase: false,
                };
                if let Err(e) = self.replicator.propose(store, &gone) {
                    self.leader.io_error |= matches!(e, StoreError::Io(_));
                }
            }
        }
        d.result(m.seq)
    }

    /// Proposes a delete marker for `subject` (a publish with the marker's headers).
    pub(crate) fn publish_marker(
        &mut self,
        store: &mut dyn Store,
        subject: Bytes,
        hdr: Vec<u8>,
    ) -> bool {
        self.publish_one(
            store,
            &subject,
            Bytes::from(hdr),
            Bytes::new(),
            Intake::Publish,
            None,
            None,
        )
        .stored()
    }

    /// Proposes an entry the leader decided by itself (expiry, retention), logging a store
    /// failure (the next commit rolls it back).
    pub(crate) fn propose_own(&mut self, store: &mut dyn Store, entry: StreamEntry) {
        if let Err(e) = self.replicator.propose(store, &entry) {
            self.leader.io_error |= matches!(e, StoreError::Io(_));
            crate::error!(self.log(), "Stream {}: {e}", self.cfg.name);
        }
    }
}

impl<R: Replicator> Actor<R> {
    fn log(&self) -> &crate::log::Log {
        self.core.stream.handle_log()
    }

    /// Commits what was proposed; on failure (the store rolled back) `refuse` turns what
    /// the batch stored into errors and the leader's memory is rebuilt from the store.
    /// True when committed.
    async fn commit(&mut self, force: bool, stored: usize, refuse: impl FnOnce(&str)) -> bool {
        let force = force || self.core.leader.io_error;
        let r = self.core.replicator.commit(&self.store, force).await;
        if force || r.is_err() {
            self.core.last_sync = Instant::now();
        }
        self.core.uncertain = if r.is_err() {
            self.core.replicator.take_uncertain()
        } else {
            None
        };
        let name = self.core.cfg.name.clone();
        let log = self.log().clone();
        let uncertain = self.core.uncertain.is_some();
        let failed = self
            .core
            .leader
            .storage_result(&log, &name, &r, stored, uncertain, refuse);
        if failed {
            let cfg = self.core.cfg.clone();
            self.core.leader.rebuild(&cfg, &mut **self.store.lock());
        }
        !failed
    }

    /// After a commit: the stream's size, the committed watermark (which wakes consumers
    /// and streams sourcing this one), the republishes.
    fn after_commit(&mut self, committed: bool) {
        let (bytes, last) = {
            let s = self.store.lock();
            (s.state().bytes, s.last_seq())
        };
        self.core.stream.set_bytes(bytes);
        if committed {
            self.core.stream.set_committed(last);
        }
        let pending = self.core.leader.take_republish();
        republish::publish(&self.core.server, &mut self.core.router, pending);
    }

    /// Stores a batch of publishes, commits once, then acknowledges.
    async fn publish_batch(&mut self, batch: &mut Vec<InMsg>) {
        let budget = self.core.budget();
        let interest = self.core.interest();
        let mut results = Vec::with_capacity(batch.len());
        {
            let mut store = self.store.lock();
            for m in batch.drain(..) {
                let hdr = m.data.slice(..m.hdr_len);
                let data = m.data.slice(m.hdr_len..);
                let r = self.core.publish_one(
                    &mut **store,
                    &m.subject,
                    hdr,
                    data,
                    Intake::Publish,
                    budget,
                    interest.as_deref(),
                );
                results.push((m.reply, r));
            }
        }
        let stored = results.iter().filter(|(_, r)| r.stored()).count();
        // What a failed commit refused: (index, what it stored), for a batch that may still
        // commit.
        let mut refused = Vec::new();
        let committed = self
            .commit(false, stored, |text| {
                for (i, (_, r)) in results.iter_mut().enumerate() {
                    if r.stored() {
                        let error = PubResult::Error(ErrorKind::StoreFailed.with(text));
                        refused.push((i, std::mem::replace(r, error)));
                    }
                }
            })
            .await;
        self.after_commit(committed);
        // Refused because this replica stopped leading: the client sends it again at once.
        // The subjects go first (the watcher would drop them a moment later), so the routes
        // hear of it before the error and the retry goes to the new leader; otherwise it
        // could still come here, after the unsubscribe, and be dropped unanswered.
        // (Errors first: the common batch has none and skips the fence's lock.)
        if results
            .iter()
            .any(|(_, r)| matches!(r, PubResult::Error(_)))
            && !self.core.replicator.is_leader()
        {
            self.core.stream.unsubscribe_subjects();
        }
        let domain = crate::jetstream::domain(&self.core.server);
        let head = AckHead::new(&self.core.cfg.name, domain);
        if let Some(fate) = self.core.uncertain.take() {
            self.answer_later(fate, &head, &mut results, refused);
        }
        for (reply, r) in results {
            let Some(reply) = reply else { continue };
            let body = Bytes::from(head.ack(&r));
            self.core.router.route_reply(
                &self.core.server,
                &Outgoing {
                    subject: &reply,
                    reply: None,
                    hdr_len: None,
                    data: &body,
                },
            );
        }
        self.core.router.flush();
    }

    /// The publishes a failed commit refused while its batch may still commit: answered
    /// once that is known, by their PubAck or the error (not at all if it never is), not
    /// now. (A publisher told "failed" of what then committed would store it twice on a
    /// retry without a message id; nats-server's new leader answers such a publish.)
    fn answer_later(
        &mut self,
        fate: super::replicator::Uncertain,
        head: &AckHead,
        results: &mut [(Option<Bytes>, PubResult)],
        refused: Vec<(usize, PubResult)>,
    ) {
        let later: Vec<(Bytes, Bytes, Bytes)> = refused
            .into_iter()
            .filter_map(|(i, stored)| {
                let (reply, error) = &mut results[i];
                let reply = reply.take()?;
                Some((reply, head.ack(&stored).into(), head.ack(error).into()))
            })
            .collect();
        if later.is_empty() {
            return;
        }
        let (server, account) = (self.core.server.clone(), self.core.stream.account().clone());
        let seed = self.core.stream.created as u64;
        tokio::spawn(async move {
            let Some(committed) = fate.await else { return };
            let mut router = Router::new(account, seed);
            for (reply, ack, error) in later {
                let body = if committed { ack } else { error };
                router.route_reply(
                    &server,
                    &Outgoing {
                        subject: &reply,
                        reply: None,
                        hdr_len: None,
                        data: &body,
                    },
                );
            }
            router.flush();
        });
    }

    /// Stores a batch from a source or the mirror, commits it, and answers its task.
    async fn sourced(&mut self, b: SourcedBatch) {
        if b.gen != self.core.stream.sourcing_gen() {
            let _ = b.done.send(vec![Taken::Refused(
                ErrorKind::StoreFailed.with("sources restarted"),
            )]);
            return;
        }
        let budget = self.core.budget();
        let interest = self.core.interest();
        let mut out = Vec::with_capacity(b.msgs.len());
        {
            let mut store = self.store.lock();
            for m in &b.msgs {
                let intake = match m.mirror {
                    Some((seq, ts)) => Intake::Mirrored { seq, ts },
                    None => Intake::Sourced,
                };
                match self.core.publish_one(
                    &mut **store,
                    &m.subject,
                    m.hdr.clone(),
                    m.data.clone(),
                    intake,
                    budget,
                    interest.as_deref(),
                ) {
                    PubResult::Stored(_) | PubResult::Counted(..) => out.push(Taken::Stored),
                    PubResult::Duplicate(_) => out.push(Taken::Skipped),
                    PubResult::Error(e) => {
                        // Later messages wait until this one can be stored.
                        out.push(Taken::Refused(e));
                        break;
                    }
                }
            }
        }
        let stored = out.iter().filter(|t| **t == Taken::Stored).count();
        // As for publishes: after a failed commit what the batch stored is refused (the
        // source offers it again later).
        let committed = self
            .commit(false, stored, |text| {
                for t in out.iter_mut() {
                    if *t == Taken::Stored {
                        *t = Taken::Refused(ErrorKind::StoreFailed.with(text));
                    }
                }
            })
            .await;
        let _ = b.done.send(out);
        self.after_commit(committed);
        self.core.router.flush();
    }

    /// Proposes an entry the API asked for and commits it durably; the store's refusal or
    /// a failed commit is the error `fail` makes of its text.
    async fn change(
        &mut self,
        entry: StreamEntry,
        fail: impl Fn(String) -> ApiError,
    ) -> Result<Applied, ApiError> {
        let r = {
            let mut store = self.store.lock();
            self.core.replicator.propose(&mut **store, &entry)
        };
        let applied = match r {
            Ok(a) => a,
            Err(e) => {
                self.core.leader.io_error |= matches!(e, StoreError::Io(_));
                // A failed write is rolled back by the next commit.
                self.commit(false, 0, |_| {}).await;
                self.after_commit(false);
                return Err(fail(e.to_string()));
            }
        };
        if applied == Applied::Removed(0) {
            return Ok(applied);
        }
        let mut why = None;
        let committed = self
            .commit(true, 0, |text| why = Some(text.to_string()))
            .await;
        self.after_commit(committed);
        match why {
            Some(text) => Err(fail(text)),
            None => Ok(applied),
        }
    }

    /// Removes what retention says may go (no commit of its own: the next one covers it).
    fn remove(&mut self, seqs: Vec<u64>) {
        if seqs.is_empty() {
            return;
        }
        let r = {
            let mut store = self.store.lock();
            self.core
                .replicator
                .propose(&mut **store, &StreamEntry::Remove { seqs, erase: false })
        };
        if let Err(e) = r {
            self.core.leader.io_error |= matches!(e, StoreError::Io(_));
        }
        let bytes = self.store.lock().state().bytes;
        self.core.stream.set_bytes(bytes);
    }

    /// Interest and work-queue retention: of `seqs` (which a consumer is done with), what
    /// every interested consumer is done with goes (on a work queue, the one consumer's
    /// ack is enough).
    fn retention(&mut self, seqs: &[u64]) {
        let retention = self.core.cfg.retention;
        if retention == Retention::Limits {
            return;
        }
        let subjects: Vec<(u64, Bytes)> = {
            let store = self.store.lock();
            seqs.iter()
                .filter_map(|&q| store.load(q).ok().map(|m| (q, m.subject)))
                .collect()
        };
        let consumers = self.core.stream.consumers.views();
        let gone = subjects
            .into_iter()
            .filter(|(q, subject)| {
                retention == Retention::Workqueue
                    || consumers.iter().all(|c| c.is_done_with(*q, subject))
            })
            .map(|(q, _)| q)
            .collect();
        self.remove(gone);
    }

    /// Interest retention after a consumer left: what no remaining consumer still needs
    /// goes, as with the reference. A rare admin operation, so a scan (in steps, the store
    /// unlocked between them) is fine.
    fn release_interest(&mut self) {
        if self.core.cfg.retention != Retention::Interest {
            return;
        }
        self.drop_done(u64::MAX, usize::MAX);
    }

    /// A new leader of an interest or work-queue stream, its consumers loaded: removals
    /// its predecessor decided but did not commit before it failed are decided again. They
    /// are of messages a consumer acked, at most up to the highest ack floor; the scan stops
    /// after `LEAD_SCAN` messages (those still pending are there too).
    fn retention_after_lead(&mut self) {
        let consumers = self.core.stream.consumers.views();
        if self.core.cfg.retention == Retention::Limits || consumers.is_empty() {
            return;
        }
        let upto = consumers.iter().map(|c| c.ack_floor()).max().unwrap_or(0);
        self.drop_done(upto, LEAD_SCAN);
    }

    /// Removes the messages up to `upto` that every consumer is done with (on a work
    /// queue, one that no consumer wants stays), looking at `limit` messages at most.
    fn drop_done(&mut self, upto: u64, limit: usize) {
        let retention = self.core.cfg.retention;
        let consumers = self.core.stream.consumers.views();
        let mut seq = self.store.lock().state().first_seq.max(1);
        let mut looked = 0;
        while looked < limit {
            let step: Vec<(u64, Bytes)> = {
                let store = self.store.lock();
                let mut v = Vec::new();
                while v.len() < RELEASE_STEP {
                    let Ok(m) = store.load_next(seq, ">") else {
                        break;
                    };
                    if m.seq > upto {
                        break;
                    }
                    seq = m.seq + 1;
                    v.push((m.seq, m.subject));
                }
                v
            };
            if step.is_empty() {
                break;
            }
            looked += step.len();
            let gone = step
                .into_iter()
                .filter(|(q, subject)| {
                    consumers.iter().all(|c| c.is_done_with(*q, subject))
                        && (retention == Retention::Interest
                            || consumers.iter().any(|c| c.wants(subject)))
                })
                .map(|(q, _)| q)
                .collect();
            self.remove(gone);
        }
    }

    /// STREAM.UPDATE: the new config is written first; only then does it go live (new
    /// limits, subscriptions, sources). A failed write leaves the old one live.
    async fn update(&mut self, cfg: StreamConfig) -> Result<(), ApiError> {
        let meta = StreamMeta {
            config: cfg,
            created: self.core.stream.created,
            cluster: self.core.stream.group.clone(),
            bootstrap: false,
        };
        super::write_meta(&self.core.stream.meta, &self.core.stream.dir, &meta).map_err(|e| {
            ErrorKind::UpdateFailed.with(format!("could not save stream config: {e}"))
        })?;
        let cfg = meta.config;
        let old = self.core.cfg.clone();
        if let Err(e) = self
            .change(StreamEntry::Config(Box::new(cfg.clone())), |t| {
                ErrorKind::UpdateFailed.with(t)
            })
            .await
        {
            // Back to the config that is live.
            let back = StreamMeta {
                config: (*old).clone(),
                created: self.core.stream.created,
                cluster: self.core.stream.group.clone(),
                bootstrap: false,
            };
            let _ = super::write_meta(&self.core.stream.meta, &self.core.stream.dir, &back);
            return Err(e);
        }
        let cfg = Arc::new(cfg);
        self.core.leader.compile(&cfg);
        self.core.cfg = cfg.clone();
        self.core.stream.set_config(cfg.clone());
        if old.subjects != cfg.subjects {
            self.core.stream.subscribe();
        }
        Ok(())
    }

    /// Commits what was proposed and no commit covered yet (retention removals wait for
    /// the next one): within a tick the replicas have them. On a server that lost the lead
    /// meanwhile the commit fails, which rolls them back out of its store.
    async fn settle(&mut self) {
        if !self.core.replicator.has_uncommitted() {
            return;
        }
        if self.core.replicator.is_leader() {
            let committed = self.commit(false, 0, |_| {}).await;
            self.after_commit(committed);
        } else {
            let _ = self.core.replicator.commit(&self.store, false).await;
            let _ = self.core.replicator.take_uncertain();
        }
    }

    /// The maintenance tick.
    async fn tick(&mut self) {
        self.settle().await;
        let now = self.core.leader.now();
        let marked = {
            let mut store = self.store.lock();
            crate::jetstream::expiry::expire(&mut self.core, &mut **store, now)
        };
        if marked {
            // Markers are stored: committed before anyone sees them.
            let committed = self.commit(true, 0, |_| {}).await;
            self.after_commit(committed);
        } else {
            let bytes = self.store.lock().state().bytes;
            self.core.stream.set_bytes(bytes);
        }
        // Damage a read found is recorded durably (the loss is reported however the
        // server stops next); in lazy mode, the interval's sync.
        let lazy_due = self
            .core
            .settings
            .sync_interval
            .is_some_and(|iv| self.core.last_sync.elapsed() >= iv);
        if lazy_due || self.store.lock().needs_sync() {
            let committed = self.commit(true, 0, |_| {}).await;
            self.after_commit(committed);
        }
        // Planning a compaction syncs what is pending first, under the store's lock: only
        // when nothing is (always after a commit in the default mode; in the interval
        // mode, right after the interval's sync).
        if self.core.settings.sync_always || lazy_due {
            self.compact();
        }
        self.core.stream.save_source_positions(false);
    }

    /// Gives file streams' disk space back: the store plans the rewrite of a segment whose
    /// messages were mostly removed (under the lock, briefly), the rewrite runs on a
    /// blocking thread while the actor goes on, and its result comes back as a command
    /// (`Compacted`), which puts it in place (briefly again). Neither publishers nor
    /// readers wait for the copy or its fsync. One rewrite at a time per stream.
    fn compact(&mut self) {
        let c = &mut self.core;
        if c.stream.storage != super::StorageType::File
            || c.compacting
            || (!c.compact_busy && c.last_compact.elapsed() < COMPACT_EVERY)
        {
            return;
        }
        c.last_compact = Instant::now();
        c.compact_busy = false;
        let Some(tx) = c.stream.commands() else {
            return;
        };
        let Some(job) = self.store.lock().compact_begin() else {
            return;
        };
        self.core.compacting = true;
        let segment = job.segment();
        // The job holds a sender: the actor does not end before its result is in.
        tokio::task::spawn_blocking(move || {
            let done = Box::new(job.run());
            let _ = tx.blocking_send(Command::Compacted { segment, done });
        });
    }

    fn compacted(&mut self, seg: u32, done: keel_store::CompactDone) {
        self.core.compacting = false;
        let r = blocking(|| self.store.lock().compact_end(done));
        let name = &self.core.cfg.name;
        match r {
            Ok(n) => {
                self.core.compact_busy = n > 0;
                crate::debug!(
                    self.log(),
                    "Stream {name}: compacted segment {seg}, {n} bytes back"
                )
            }
            Err(e) => crate::warn!(
                self.log(),
                "Stream {name}: compacting segment {seg} failed: {e}"
            ),
        }
    }

    async fn command(&mut self, c: Command, sourced_tx: &mpsc::Sender<SourcedBatch>) {
        #[cfg(test)]
        if let Command::Panic = c {
            panic!(
                "stream {}: a test asked its actor to panic",
                self.core.cfg.name
            );
        }
        if let Command::Lead { reply } = c {
            // What this server applied as a follower is made durable first: a rollback after
            // a failed commit must only drop what it decided itself.
            let replica = self.core.stream.replica.get().cloned();
            let r = replica
                .map_or(Ok(()), |r| r.consumers_durable())
                .and_then(|_| self.store.sync());
            if let Err(e) = r {
                crate::error!(
                    self.log(),
                    "Stream {}: sync on taking the lead failed: {e}",
                    self.core.cfg.name
                );
                let _ = reply.send(false);
                return;
            }
            let cfg = self.core.stream.config();
            self.core.leader.compile(&cfg);
            self.core.leader.rebuild(&cfg, &mut **self.store.lock());
            let sourcing = cfg.mirror.is_some() || !cfg.sources.is_empty();
            self.core.cfg = cfg;
            if sourcing {
                // The sources' tasks start again from what this store holds (the newest
                // `Nats-Stream-Source` per origin): as a follower their positions stood
                // still (the batches they offered were refused), and going on from there
                // would store the leader's messages a second time.
                self.core
                    .stream
                    .restart_sourcing(&self.core.server, sourced_tx, true);
            }
            let _ = reply.send(true);
            return;
        }
        if let Command::Replicate { entry, reply } = c {
            // Committed = on a quorum's logs, which is what a confirmed ack promises; the
            // store holds no consumer state, so its sync waits for its turn.
            let r = if self.core.replicator.propose_consumer(entry) {
                self.core
                    .replicator
                    .commit(&self.store, false)
                    .await
                    .map_err(|_| ErrorKind::ClusterUnavailable.err())
            } else {
                Err(ErrorKind::ClusterUnavailable.err())
            };
            if let Some(reply) = reply {
                let _ = reply.send(r);
            }
            return;
        }
        if let Command::Nudge = c {
            if self.core.replicator.has_uncommitted() {
                // (A batch replicates as well as an empty one.)
                self.settle().await;
            } else if self.core.replicator.is_leader() {
                self.core.replicator.nudge().await;
            }
            return;
        }
        if !self.core.replicator.is_leader() {
            // A follower's actor decides nothing: the leader's entries reach its store
            // through the group's state machine.
            match c {
                Command::Purge { reply, .. } => {
                    let _ = reply.send(Err(ErrorKind::ClusterUnavailable.err()));
                }
                Command::DeleteMsg { reply, .. } => {
                    let _ = reply.send(Err(ErrorKind::ClusterUnavailable.err()));
                }
                Command::Update { reply, .. } | Command::SkipTo { reply, .. } => {
                    let _ = reply.send(Err(ErrorKind::ClusterUnavailable.err()));
                }
                Command::Tick => self.settle().await,
                _ => {}
            }
            return;
        }
        match c {
            Command::Purge { req, reply } => {
                let r = match decide::decide_purge(&self.core.cfg, &req) {
                    Ok(e) => self
                        .change(e, |t| ErrorKind::PurgeFailed.with(t))
                        .await
                        .map(|a| match a {
                            Applied::Purged(n) => n,
                            _ => 0,
                        }),
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
            Command::DeleteMsg { seq, erase, reply } => {
                let r = match decide::decide_delete(&self.core.cfg, seq, erase) {
                    Ok(e) => match self.change(e, |t| ErrorKind::MsgDeleteFailed.with(t)).await {
                        Ok(Applied::Removed(0)) => Err(ErrorKind::SequenceNotFound.with(seq)),
                        Ok(_) => Ok(()),
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
            Command::Update { cfg, reply } => {
                let old = self.core.cfg.clone();
                let r = self.update(*cfg).await;
                let cfg = self.core.cfg.clone();
                if r.is_ok() && (old.mirror != cfg.mirror || old.sources != cfg.sources) {
                    self.core
                        .stream
                        .restart_sourcing(&self.core.server, sourced_tx, true);
                }
                let _ = reply.send(r);
            }
            Command::SkipTo { next, reply } => {
                let r = self
                    .change(StreamEntry::SkipTo { next }, |t| {
                        ErrorKind::StreamCreate.with(format!("could not create stream: {t}"))
                    })
                    .await
                    .map(|_| ());
                let _ = reply.send(r);
            }
            Command::Retention { seqs } => self.retention(&seqs),
            Command::ReleaseInterest => self.release_interest(),
            Command::RetentionAfterLead => self.retention_after_lead(),
            Command::Tick => self.tick().await,
            Command::Compacted { segment, done } => self.compacted(segment, *done),
            Command::Delete { .. }
            | Command::Lead { .. }
            | Command::Replicate { .. }
            | Command::Drain { .. }
            | Command::Nudge => {
                unreachable!("handled before")
            }
            #[cfg(test)]
            Command::Panic => unreachable!("handled before"),
        }
        self.core.router.flush();
    }

    /// STREAM.DELETE: the store's data goes for good.
    fn destroy(&mut self) {
        self.core.stream.stop_sourcing();
        let store = self.store.take();
        if let Err(e) = store.destroy() {
            crate::error!(
                self.log(),
                "Stream {}: could not remove its data: {e}",
                self.core.cfg.name
            );
        }
        self.core.stream.set_bytes(0);
    }

    /// The actor ends (shutdown): the store is synced and closed (its index saved).
    fn close(&mut self) {
        let replica = self.core.stream.replica.get().cloned();
        let r = blocking(|| {
            let consumers = replica.map_or(Ok(()), |r| r.consumers_durable());
            let mut s = self.store.lock();
            // Closed whatever the sync says: a store left open closes itself when its
            // last holder drops it (a Raft group's tasks may outlive the actor), writing
            // its heads and index into a directory that, loaded again, another instance
            // owns by then (the fault checker's full disks found replicas damaged so).
            let synced = s.sync();
            let closed = s.close();
            consumers.and(synced).and(closed)
        });
        if let Err(e) = r {
            crate::error!(
                self.log(),
                "Stream {}: error closing store: {e}",
                self.core.cfg.name
            );
        }
    }
}

/// How many batches `Command::Drain` handles at most.
const DRAIN_BATCHES: usize = 16;

/// The actor's loop. It ends on STREAM.DELETE, or once its ingest queue has ended
/// (shutdown, or the stream unsubscribed) and nobody can send it a command any more.
pub async fn run<R: Replicator>(
    mut a: Actor<R>,
    mut ingest: crate::inqueue::Receiver,
    mut commands: mpsc::Receiver<Command>,
    keepalive: mpsc::Sender<Command>,
    mut sourced: mpsc::Receiver<SourcedBatch>,
    sourced_tx: mpsc::Sender<SourcedBatch>,
) {
    // While the ingest queue is open the actor keeps its own command sender, so the queue
    // cannot close under it.
    let mut keepalive = Some(keepalive);
    let mut batch = Vec::with_capacity(256);
    loop {
        tokio::select! {
            n = ingest.recv_many(&mut batch, BATCH_MSGS, BATCH_BYTES), if keepalive.is_some() => {
                if n == 0 {
                    keepalive = None;
                    continue;
                }
                a.publish_batch(&mut batch).await;
                if batch.capacity() > 1024 && ingest.is_empty() {
                    // A burst is over: do not keep its batch's capacity.
                    batch = Vec::with_capacity(256);
                }
            }
            c = commands.recv() => match c {
                Some(Command::Delete { reply }) => {
                    a.destroy();
                    a.core.stream.set_ended();
                    let _ = reply.send(());
                    return;
                }
                Some(Command::Drain { reply }) => {
                    // At most what is queued now (bounded: under load more keeps coming).
                    for _ in 0..DRAIN_BATCHES {
                        if ingest.try_recv_many(&mut batch, BATCH_MSGS, BATCH_BYTES) == 0 {
                            break;
                        }
                        a.publish_batch(&mut batch).await;
                    }
                    let _ = reply.send(());
                }
                Some(c) => a.command(c, &sourced_tx).await,
                None => break,
            },
            Some(b) = sourced.recv() => a.sourced(b).await,
        }
    }
    // Shutdown: the sources' positions (durably), then the store.
    a.core.stream.save_source_positions(true);
    a.core.stream.stop_sourcing();
    a.close();
    a.core.stream.set_ended();
}

/// The start of a stream's PubAcks, made once per batch: `{"stream":<name>` (JSON), and
/// the same with the domain, which successful acks name (errors do not), as the reference.
struct AckHead {
    name: String,
    stored: String,
}

impl AckHead {
    fn new(stream: &str, domain: Option<&str>) -> AckHead {
        let name = serde_json::to_string(stream).expect("string serializes");
        let domain = domain
            .map(|d| format!(",\"domain\":{}", serde_json::to_string(d).expect("string")))
            .unwrap_or_default();
        let stored = format!("{{\"stream\":{name}{domain}");
        AckHead { name, stored }
    }

    fn ack(&self, r: &PubResult) -> Vec<u8> {
        use std::io::Write;
        let mut out = Vec::with_capacity(self.stored.len() + 32);
        match r {
            PubResult::Stored(seq) => {
                let _ = write!(out, "{},\"seq\":{seq}}}", self.stored);
            }
            PubResult::Counted(seq, val) => {
                let val = serde_json::to_string(val).expect("string serializes");
                let _ = write!(out, "{},\"seq\":{seq},\"val\":{val}}}", self.stored);
            }
            // The one non-compact JSON the reference sends: a space after the colon.
            PubResult::Duplicate(seq) => {
                let _ = write!(out, "{},\"seq\":{seq},\"duplicate\": true}}", self.stored);
            }
            PubResult::Error(e) => {
                out.extend_from_slice(b"{\"error\":");
                out.extend_from_slice(&crate::jetstream::api::to_bytes(&e.to_json()));
                let _ = write!(out, ",\"stream\":{},\"seq\":0}}", self.name);
            }
        }
        out
    }
}
