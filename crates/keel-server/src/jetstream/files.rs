//! JetStream's metadata files (stream config, consumer config and state) and what the
//! server says about storage faults. The files go through keel-store's checksummed,
//! atomically replaced [`MetaFiles`] (the same I/O seam the crash simulator covers); this
//! module adds the logging, so every damaged, missing or cut record is reported with its
//! stream and sequence range.

use std::path::Path;

use crate::log::Log;
use keel_store::{MetaFiles, MetaRead, RecoveryReport, State, StoreEvent};

/// The newest copy of `path` that verifies, through `meta` (the JetStream instance's
/// metadata files: each remembers which files it made durable). `what` names it in log
/// lines. None when there is no copy at all; Err when copies exist and none verifies.
pub fn read(
    meta: &MetaFiles,
    path: &Path,
    what: &str,
    log: &Log,
) -> Result<Option<Vec<u8>>, String> {
    match meta.read(path) {
        MetaRead::Missing => Ok(None),
        MetaRead::Current(b) => Ok(Some(b)),
        MetaRead::Older { body, damage } => {
            crate::warn!(log, "{what} {} is damaged ({damage})", path.display());
            Ok(Some(body))
        }
        MetaRead::Unchecked(b) => {
            crate::warn!(log, "{what} {} has no checksum (written by an older Keel); it is rewritten with one at the next change",
                path.display()
            );
            Ok(Some(b))
        }
        MetaRead::Damaged(why) => Err(format!("{} is damaged: {why}", path.display())),
    }
}

/// "1..5, 9, 12..20" (the first few ranges of many).
pub fn ranges(r: &[(u64, u64)]) -> String {
    const SHOWN: usize = 8;
    let mut parts: Vec<String> = r
        .iter()
        .take(SHOWN)
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}..{b}")
            }
        })
        .collect();
    if r.len() > SHOWN {
        parts.push(format!("and {} more ranges", r.len() - SHOWN));
    }
    parts.join(", ")
}

fn count(r: &[(u64, u64)]) -> u64 {
    r.iter().map(|&(a, b)| b - a + 1).sum()
}

fn to_ranges(seqs: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &s in seqs {
        match out.last_mut() {
            Some((_, b)) if *b + 1 == s => *b = s,
            _ => out.push((s, s)),
        }
    }
    out
}

/// Logs what opening (or rebuilding) a file stream found.
pub fn log_recovery(
    log: &Log,
    stream: &str,
    dir: &Path,
    rep: &RecoveryReport,
    state: Option<&State>,
) {
    if let Some(why) = &rep.index_rejected {
        crate::warn!(
            log,
            "Stream {stream}: saved index not used ({why}); rebuilt from the segments"
        );
    }
    for t in &rep.torn {
        crate::warn!(log, "Stream {stream}: incomplete write of {} bytes in segment {} at offset {} (after the last completed sync, never acknowledged){}",
            t.bytes,
            t.segment,
            t.offset,
            if t.cut { "; cut" } else { "" }
        );
    }
    for d in &rep.damaged {
        match (&d.quarantine, &d.quarantine_error) {
            (Some(q), _) => crate::error!(log, "Stream {stream}: damaged data in segment {} at offset {} ({} bytes), copied to {}",
                d.segment,
                d.offset,
                d.bytes,
                dir.join(q).display()
            ),
            (None, e) => crate::error!(log, "Stream {stream}: damaged data in segment {} at offset {} ({} bytes) left in place: could not copy it aside: {}",
                d.segment,
                d.offset,
                d.bytes,
                e.as_deref().unwrap_or("unknown error")
            ),
        }
    }
    if !rep.lost.is_empty() {
        crate::error!(log, "Stream {stream}: lost {} messages, sequences {}: damaged or missing on disk although synced; not served, reported in state.lost",
            count(&rep.lost),
            ranges(&rep.lost)
        );
    }
    if !rep.unacked.is_empty() {
        crate::warn!(log, "Stream {stream}: sequences {} were handed out but are not on disk: written after the last sync known complete (never acknowledged, unless the disk lost synced data); they are not reused",
            ranges(&rep.unacked)
        );
    }
    if let Some((from, to)) = rep.segments_missing {
        crate::error!(log, "Stream {stream}: its newest segment files are missing: the messages after sequence {} are gone (up to sequence {to} may have been handed out); no sequence up to {to} is handed out again (those sequences are recorded as gone: segment files put back later are not read)",
            from - 1
        );
    }
    if let (Some(found), Some(st)) = (rep.records_last_seq, state) {
        crate::warn!(
            log,
            "Stream {stream}: last sequence kept at {} although the records on disk end at {found}",
            st.last_seq
        );
    }
    if let Some(l) = state.and_then(|s| s.lost.as_ref()) {
        let all = to_ranges(&l.msgs);
        if all != rep.lost {
            crate::warn!(
                log,
                "Stream {stream} has {} lost messages ({} bytes), sequences {}",
                l.msgs.len(),
                l.bytes,
                ranges(&all)
            );
        }
    }
}

/// What a file stream's store reports while running: damage found by a read, and the
/// rebuild after a failed write.
pub fn observer(log: Log, stream: String, dir: std::path::PathBuf) -> keel_store::file::Observer {
    Box::new(move |e| {
        match e {
        StoreEvent::ReadDamage(d) => match &d.quarantine {
            Some(q) => crate::error!(log, "Stream {stream}: message {} is damaged (segment {}, offset {}, {} bytes, copied to {}); lost: not served, reported in state.lost",
                d.seq,
                d.segment,
                d.offset,
                d.bytes,
                dir.join(q).display()
            ),
            None => crate::error!(log, "Stream {stream}: message {} is damaged (segment {}, offset {}, {} bytes; could not copy it aside: {}); lost: not served, reported in state.lost",
                d.seq,
                d.segment,
                d.offset,
                d.bytes,
                d.quarantine_error.as_deref().unwrap_or("unknown error")
            ),
        },
        StoreEvent::Recovered(rep) => {
            // The failure itself is logged by the stream (once per outage).
            crate::debug!(log, "Stream {stream}: rolled back to the last completed sync after a storage failure; index rebuilt from disk"
            );
            log_recovery(&log, &stream, &dir, rep, None);
        }
    }
    })
}
