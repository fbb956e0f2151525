//! The file operations the file store needs, behind a small trait so the fault-injection
//! tests can swap the real filesystem for a simulated one that loses unsynced data.

use std::io;
use std::path::Path;
use std::sync::Arc;

/// Directory-level operations.
pub(crate) trait Fs: Send + Sync {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// File names (not paths) in `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Opens read-write, creating the file if `create`.
    fn open(&self, path: &Path, create: bool) -> io::Result<Box<dyn FsFile>>;
    fn remove(&self, path: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes creations, removals and renames in `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Makes this caller the one owner of `dir` until the returned guard drops: a second
    /// `lock` of the same directory fails (`WouldBlock`) meanwhile, in this process too.
    fn lock(&self, dir: &Path) -> io::Result<Box<dyn Send>>;
}

/// One open file. Writes are positional: the store keeps its own append offset.
pub(crate) trait FsFile: Send {
    fn len(&self) -> io::Result<u64>;
    /// Fills `buf` from `off`; short files are an error.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()>;
    /// fdatasync.
    fn sync(&mut self) -> io::Result<()>;
    fn truncate(&mut self, len: u64) -> io::Result<()>;
    /// Makes the file at least `len` bytes long, the new part reading as zeros, with its
    /// blocks allocated now (so later writes there do not change the file's size). With
    /// `write_zeros` the zeros are written, so later writes there do not change the file's
    /// extents either and their fdatasync flushes data only: worth it for small writes,
    /// whose fdatasync is mostly that metadata; large ones would copy twice the bytes.
    fn allocate(&mut self, len: u64, write_zeros: bool) -> io::Result<()>;
}

/// A Raft log's appends smaller than this allocate ahead with written zeros
/// (`FsFile::allocate`), larger ones with fallocate: a stream of large writes copies the
/// zeros as well (a file store taking 64 KiB messages lost 13% of its throughput), while its
/// fdatasyncs are mostly data anyway.
pub(crate) const ZERO_FILL_BELOW: usize = 256 << 10;

/// A sync job's fsyncs: each file's data, then the directory's entries (when it made any).
pub(crate) fn sync_files<'a>(
    files: impl Iterator<Item = &'a mut Box<dyn FsFile>>,
    dir: &Option<(Arc<dyn Fs>, std::path::PathBuf)>,
) -> io::Result<()> {
    for f in files {
        f.sync()?;
    }
    if let Some((fs, dir)) = dir {
        fs.sync_dir(dir)?;
    }
    Ok(())
}

/// The real filesystem.
pub(crate) struct StdFs;

struct StdFile(std::fs::File);

impl Fs for StdFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir)? {
            if let Ok(name) = e?.file_name().into_string() {
                out.push(name);
            }
        }
        Ok(out)
    }
    fn open(&self, path: &Path, create: bool) -> io::Result<Box<dyn FsFile>> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)?;
        Ok(Box::new(StdFile(f)))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::File::open(dir)?.sync_all()
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }
    fn lock(&self, dir: &Path) -> io::Result<Box<dyn Send>> {
        use std::os::fd::AsRawFd;
        // flock belongs to the open file description: another open of the directory (by
        // this process too) is refused while this one holds it; the kernel drops it with
        // the descriptor, however the process ends.
        let f = std::fs::File::open(dir)?;
        // SAFETY: flock(2) on a descriptor this function owns; no memory is passed.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} is in use by another open store", dir.display()),
                ));
            }
            return Err(e);
        }
        Ok(Box::new(f))
    }
}

impl FsFile for StdFile {
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, off)
    }
    fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, buf, off)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn allocate(&mut self, len: u64, write_zeros: bool) -> io::Result<()> {
        if !write_zeros {
            use std::os::fd::AsRawFd;
            // SAFETY: fallocate(2) on a descriptor this file owns; no memory is passed.
            let r = unsafe { libc::fallocate(self.0.as_raw_fd(), 0, 0, len as libc::off_t) };
            return if r == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            };
        }
        // fallocate leaves unwritten extents: the first write into one still changes the
        // file's metadata, which its fdatasync then writes as a growing file's does
        // (measured on ext4, three writers of 33 KB batches: growing 308 us per fdatasync,
        // fallocated 290, zero-filled 193).
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let mut at = self.0.metadata()?.len();
        while at < len {
            let n = (len - at).min(ZEROS.len() as u64) as usize;
            std::os::unix::fs::FileExt::write_all_at(&self.0, &ZEROS[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }
}

/// The filesystem a store writes through: the real one ([`Disk::real`], the default), or
/// the real one behind a switch that makes it act as a full disk ([`Disk::fillable`]), so
/// tests can fill one server's disk, or one directory of it, in a process that runs several.
#[derive(Clone)]
pub struct Disk(Arc<dyn Fs>);

impl Disk {
    pub fn real() -> Disk {
        Disk(Arc::new(StdFs))
    }

    /// The real filesystem, full under the paths [`DiskFull::fill`] names until
    /// [`DiskFull::free`], its fsyncs held under those [`DiskFull::stall`] names. As on
    /// ext4 with no free block: a write that needs a new block fails
    /// with ENOSPC (`StorageFull`), one into space already allocated succeeds, and syncs,
    /// truncations, renames and removals go on working.
    pub fn fillable() -> (Disk, DiskFull) {
        let full = DiskFull::new();
        (Disk(Arc::new(Fillable { full: full.clone() })), full)
    }

    pub(crate) fn fs(&self) -> Arc<dyn Fs> {
        self.0.clone()
    }
}

impl Default for Disk {
    fn default() -> Disk {
        Disk::real()
    }
}

impl PartialEq for Disk {
    fn eq(&self, o: &Disk) -> bool {
        Arc::ptr_eq(&self.0, &o.0)
    }
}

impl Eq for Disk {}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Disk")
    }
}

/// The switch of a [`Disk::fillable`].
#[derive(Clone)]
pub struct DiskFull(Arc<(std::sync::Mutex<Switch>, std::sync::Condvar)>);

#[derive(Default)]
struct Switch {
    full: Vec<std::path::PathBuf>,
    stalled: Vec<std::path::PathBuf>,
}

impl DiskFull {
    fn new() -> DiskFull {
        DiskFull(Arc::default())
    }

    fn switch(&self) -> std::sync::MutexGuard<'_, Switch> {
        self.0 .0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on, no new block can be written under `dir` (its subdirectories too).
    pub fn fill(&self, dir: &Path) {
        self.switch().full.push(dir.to_path_buf());
    }

    /// Every directory has room again.
    pub fn free(&self) {
        self.switch().full.clear();
    }

    /// From now on, a file's fsync under `dir` does not return until [`DiskFull::unstall`]
    /// (a disk that stopped answering: the calling thread waits).
    pub fn stall(&self, dir: &Path) {
        self.switch().stalled.push(dir.to_path_buf());
    }

    /// The stalled fsyncs go on.
    pub fn unstall(&self) {
        self.switch().stalled.clear();
        self.0 .1.notify_all();
    }

    fn is_full(&self, path: &Path) -> bool {
        self.switch().full.iter().any(|d| path.starts_with(d))
    }

    fn wait_unstalled(&self, path: &Path) {
        let mut g = self.switch();
        while g.stalled.iter().any(|d| path.starts_with(d)) {
            g = self.0 .1.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// `len` rounded up to whole 4 KiB blocks, as a filesystem allocates.
fn blocks(len: u64) -> u64 {
    len.div_ceil(4096) * 4096
}

fn no_space() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOSPC)
}

struct Fillable {
    full: DiskFull,
}

/// A file of a [`Fillable`]: `allocated` is what it can write without a new block.
struct FillableFile {
    file: Box<dyn FsFile>,
    path: std::path::PathBuf,
    full: DiskFull,
    allocated: u64,
}

impl Fs for Fillable {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        if !dir.exists() && self.full.is_full(dir) {
            return Err(no_space());
        }
        StdFs.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        StdFs.list(dir)
    }
    fn open(&self, path: &Path, create: bool) -> io::Result<Box<dyn FsFile>> {
        let file = StdFs.open(path, create)?;
        let allocated = blocks(file.len()?);
        Ok(Box::new(FillableFile {
            file,
            path: path.to_path_buf(),
            full: self.full.clone(),
            allocated,
        }))
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        StdFs.remove(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        StdFs.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        StdFs.sync_dir(dir)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        StdFs.remove_dir_all(dir)
    }
    fn lock(&self, dir: &Path) -> io::Result<Box<dyn Send>> {
        StdFs.lock(dir)
    }
}

impl FillableFile {
    /// Room for the file to reach `end`: taken now, or refused on a full disk.
    fn take(&mut self, end: u64) -> io::Result<()> {
        if end > self.allocated && self.full.is_full(&self.path) {
            return Err(no_space());
        }
        Ok(())
    }
}

impl FsFile for FillableFile {
    fn len(&self) -> io::Result<u64> {
        self.file.len()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.file.read_at(buf, off)
    }
    fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()> {
        let end = off + buf.len() as u64;
        if let Err(e) = self.take(end) {
            // As write(2) on a full disk: what fits in the allocated blocks is written,
            // then ENOSPC.
            let fits = self.allocated.saturating_sub(off).min(buf.len() as u64) as usize;
            if fits > 0 {
                self.file.write_at(&buf[..fits], off)?;
            }
            return Err(e);
        }
        self.file.write_at(buf, off)?;
        self.allocated = self.allocated.max(blocks(end));
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        self.full.wait_unstalled(&self.path);
        self.file.sync()
    }
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.file.truncate(len)?;
        // A cut frees its blocks; a longer file made by truncation is a hole (no blocks).
        self.allocated = self.allocated.min(blocks(len));
        Ok(())
    }
    fn allocate(&mut self, len: u64, write_zeros: bool) -> io::Result<()> {
        self.take(len)?;
        self.file.allocate(len, write_zeros)?;
        self.allocated = self.allocated.max(blocks(len));
        Ok(())
    }
}
