//! What survives a restart besides the messages: the stream's config and creation time,
//! in a checksummed, atomically replaced file through the JetStream's `MetaFiles`.

use std::path::Path;

use keel_store::MetaFiles;
use serde::{Deserialize, Serialize};

use super::config::StreamConfig;

#[derive(Serialize, Deserialize)]
pub struct StreamMeta {
    pub config: StreamConfig,
    pub created: i64,
    /// A replicated stream's Raft group (clustered JetStream, num_replicas > 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<crate::jetstream::raft::stream::GroupSpec>,
    /// Just created here as the group's first peer: this server forms the group.
    #[serde(skip)]
    pub bootstrap: bool,
}

const FILE: &str = "keel-meta.json";

/// Writes the stream's config durably (checksummed, replaced atomically).
pub fn write_meta(files: &MetaFiles, dir: &Path, meta: &StreamMeta) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(meta).map_err(std::io::Error::other)?;
    files.write(&dir.join(FILE), &body, true)
}

pub fn read_meta(
    files: &MetaFiles,
    dir: &Path,
    log: &crate::log::Log,
) -> Result<StreamMeta, String> {
    let b = crate::jetstream::files::read(files, &dir.join(FILE), "Stream config", log)?
        .ok_or("no stream config (keel-meta.json)")?;
    serde_json::from_slice(&b).map_err(|e| e.to_string())
}

/// A consumer directory holding nothing but temporary files: what a create that failed
/// before writing its config leaves.
pub fn leftover(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .all(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
    })
}
