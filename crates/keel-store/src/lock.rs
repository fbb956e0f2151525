//! One process per store directory: an advisory `flock` on `<dir>/keel.lock`, held for the
//! life of the process. The kernel drops it when the process exits however it exits
//! (SIGKILL included), so a stale lock never needs cleaning up. The file holds the holder's
//! pid so the refusal can name it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

const NAME: &str = "keel.lock";

/// Held while alive; dropping it (or exiting) releases the lock.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    pub path: PathBuf,
}

/// Takes the lock on `dir` (created if needed) or says who holds it.
pub fn lock_dir(dir: &Path) -> Result<DirLock, String> {
    if dir.exists() && !dir.is_dir() {
        // The reference's words.
        return Err(format!(
            "storage directory is not a directory: {}",
            dir.display()
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let path = dir.join(NAME);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor we own; no memory is involved.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let holder = match text.trim().parse::<u32>() {
                Ok(pid) => format!("pid {pid}"),
                Err(_) => "pid unknown".into(),
            };
            return Err(format!(
                "store directory {} is in use by another process ({holder}, lock {})",
                dir.display(),
                path.display()
            ));
        }
        return Err(format!("cannot lock {}: {err}", path.display()));
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|_| file.write_all(pid.as_bytes()))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(DirLock { _file: file, path })
}
