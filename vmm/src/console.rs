//! The guest's serial console as a file of bounded size.
//!
//! A guest writes COM1 as fast as it likes, and every byte lands in a file on
//! the host: left alone, a guest printing in a loop fills the node's disk.
//! [`BoundedFile`] keeps the console at `path` under `max` bytes and its
//! previous part at `path.1` (also under `max`): when `path` is full, its
//! contents move to `path.1` (replacing it) and `path` starts empty again.
//! Both files are opened when the console is (writes happen on vCPU threads,
//! whose seccomp filter opens and renames nothing): the move is a copy
//! through the open descriptors and a truncation, so a reader holding `path`
//! open sees it shrink, as with logrotate's `copytruncate`. A console that
//! is not a regular file (a pipe, a terminal, `/dev/null`) is written as it
//! is: whoever reads it holds what it keeps ([`open`]).

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::devices::SerialOut;
use crate::error::{Error, Result};

/// Bytes copied at a time when the console rotates.
const COPY_CHUNK: usize = 64 * 1024;

/// A console file that never grows past its bound; see the module.
pub struct BoundedFile {
    /// The console, opened for appending.
    current: File,
    /// Its previous part, `<path>.1`.
    previous: File,
    /// Bytes in `current`.
    len: u64,
    /// The most bytes either file holds.
    max: u64,
}

/// The path of the console's previous part: `<path>.1`.
pub fn previous_path(path: &Path) -> PathBuf {
    let mut p = OsString::from(path.as_os_str());
    p.push(".1");
    PathBuf::from(p)
}

/// Opens the serial console at `path` (created if missing, appended to): a
/// regular file as a [`BoundedFile`] of at most `max` bytes, anything else
/// (a pipe, a terminal, a device) as it is.
pub fn open(path: &Path, max: u64) -> Result<SerialOut> {
    let current = open_file(path, true)?;
    let meta = current
        .metadata()
        .map_err(|e| Error::io(format!("serial output {}", path.display()), e))?;
    if !meta.is_file() {
        return Ok(Box::new(current));
    }
    Ok(Box::new(BoundedFile::with(path, current, meta.len(), max)?))
}

fn open_file(path: &Path, append: bool) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .read(true)
        .write(!append)
        .append(append)
        .open(path)
        .map_err(|e| Error::io(format!("opening serial output {}", path.display()), e))
}

impl BoundedFile {
    /// Opens (creating them if missing) the console file at `path`,
    /// appended to, and its previous part `<path>.1`; neither will hold more
    /// than `max` bytes (at least 1).
    pub fn open(path: &Path, max: u64) -> Result<BoundedFile> {
        let current = open_file(path, true)?;
        let len = current
            .metadata()
            .map_err(|e| Error::io(format!("serial output {}", path.display()), e))?
            .len();
        BoundedFile::with(path, current, len, max)
    }

    /// The console `current`, holding `len` bytes, opened from `path`.
    fn with(path: &Path, current: File, len: u64, max: u64) -> Result<BoundedFile> {
        if max == 0 {
            return Err(Error::Config(format!(
                "serial output {}: a bound of 0 bytes",
                path.display()
            )));
        }
        Ok(BoundedFile {
            current,
            previous: open_file(&previous_path(path), false)?,
            len,
            max,
        })
    }

    /// Moves the last `max` bytes of the console into its previous part and
    /// empties the console.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.previous.set_len(0)?;
        let start = self.len.saturating_sub(self.max);
        let mut buf = vec![0u8; COPY_CHUNK];
        let mut at = start;
        while at < self.len {
            let want = (self.len - at).min(COPY_CHUNK as u64) as usize;
            let n = self.current.read_at(&mut buf[..want], at)?;
            if n == 0 {
                break;
            }
            self.previous.write_all_at(&buf[..n], at - start)?;
            at += n as u64;
        }
        self.current.set_len(0)?;
        self.len = 0;
        Ok(())
    }
}

impl Write for BoundedFile {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        if self.len >= self.max {
            self.rotate()?;
        }
        let room = usize::try_from(self.max - self.len).unwrap_or(usize::MAX);
        let n = self.current.write(&data[..data.len().min(room)])?;
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.current.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    #[test]
    fn the_console_rotates_once_and_stays_under_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        std::fs::write(&path, b"earlier run\n").unwrap();
        let mut f = BoundedFile::open(&path, 100).unwrap();
        let line: Vec<u8> = (0..7u8).map(|i| b'a' + i).chain([b'\n']).collect();
        for _ in 0..1000 {
            f.write_all(&line).unwrap();
            assert!(std::fs::metadata(&path).unwrap().len() <= 100);
            assert!(std::fs::metadata(previous_path(&path)).unwrap().len() <= 100);
        }
        // 12 + 8,000 bytes: rotated at every 100, 12 left in the console.
        let now = std::fs::read(&path).unwrap();
        let before = std::fs::read(previous_path(&path)).unwrap();
        assert_eq!(now.len(), 12);
        assert_eq!(before.len(), 100);
        let all: Vec<u8> = b"earlier run\n"
            .iter()
            .copied()
            .chain(line.iter().copied().cycle().take(8000))
            .collect();
        assert_eq!(
            [before, now].concat(),
            all[all.len() - 112..],
            "the newest bytes, in order"
        );
        // Reopened (a new VM in the same VMM), it goes on from the size it finds.
        let mut f = BoundedFile::open(&path, 100).unwrap();
        f.write_all(&[b'x'; 95]).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 7);
        assert!(BoundedFile::open(&path, 0).is_err());
    }

    #[test]
    fn a_console_that_is_not_a_regular_file_is_written_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Open for reading first (without blocking), so the console can open it.
        let mut reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let mut out = open(&fifo, 4).unwrap();
        out.write_all(b"more than four").unwrap();
        let mut got = String::new();
        std::io::Read::read_to_string(&mut reader, &mut got).ok();
        assert_eq!(got, "more than four");
        assert!(!previous_path(&fifo).exists(), "no previous part");
    }

    #[test]
    fn the_console_rotates_under_the_vcpu_seccomp_filter() {
        // vCPU threads write the console: the filter must allow a rotation,
        // or the VMM dies of SIGSYS (and this test process with it).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        let mut f = BoundedFile::open(&path, 10).unwrap();
        std::thread::spawn(move || {
            crate::jail::seccomp::install(crate::jail::seccomp::Role::Vcpu)
                .expect("installing the vCPU filter");
            f.write_all(&[b'z'; 25]).unwrap();
        })
        .join()
        .expect("the confined thread");
        assert_eq!(std::fs::read(&path).unwrap(), [b'z'; 5]);
        assert_eq!(std::fs::read(previous_path(&path)).unwrap(), [b'z'; 10]);
    }
}
