//! Pre-copy of a full snapshot: guest memory is copied into the snapshot's
//! memory file while the guest runs, and the guest is paused only for the
//! pages it changed meanwhile.
//!
//! 1. KVM's dirty log (and the VMM's own dirty bitmap) is read once, so
//!    that every change from then on is logged; then every page of RAM is
//!    copied into the memory file (a booted VM's untouched pages are holes
//!    in its memfd and stay holes in the file), and written back to disk
//!    (waited for: the fsync after the pause then has little left, and no
//!    writeback of the file competes for the host's CPUs during the pause).
//! 2. Rounds: the pages changed during the previous round are read from
//!    the log and copied again, until at most [`DONE_PAGES`] changed, or a
//!    round found no fewer changed pages than the round before copied (the
//!    guest writes as fast as we copy), or after [`MAX_ROUNDS`] rounds.
//!    A buffer is faulted in for what is left plus twice the most pages
//!    one round saw changed.
//! 3. Paused (`persist.rs`): the log is read a last time; the pages changed
//!    since the last round (and those the last round left) are copied into
//!    the buffer with the vCPU and device state; the guest runs again and
//!    the buffer is written over the file. A final set over `COPY_LIMIT`
//!    (64 MiB) is written into the file while paused instead.
//!
//! Exactness: a page is copied after the log was read at the start of its
//! round, so a write to it that the copy may have missed is a write after
//! that read, which the next read of the log reports; the last read is
//! made with the guest paused, and what it reports is copied then. Pages
//! the balloon drops are marked in the VMM's bitmap after the drop and are
//! copied again like any changed page (reading zeros or the mapped file's
//! bytes, as the guest would). Every read of the log is also folded into
//! the VM's set of pages changed since its baseline, so a snapshot that
//! fails leaves that set whole.
//!
//! A VM that was paused for the call is copied the same way (the rounds
//! find nothing changed) and then runs on the memory file, as a template
//! does. A running VM is not remapped onto the file: mapping it over RAM
//! would be part of the pause and cost time in proportion to the memory
//! the guest touched. It keeps its memory, and its baseline is the new
//! snapshot: a rollback to it copies the pages changed since from the
//! file, or maps the file over RAM once when they are many (`rollback.rs`).

use std::path::Path;

use crate::error::{Error, Result};
use crate::memory::{PageSet, PAGE_SIZE};
use crate::precopy::MemoryWriter;
use crate::snapshot::{MemoryFile, PageCopy};

use super::persist::COPY_LIMIT;
use super::Vm;

/// Rounds after the first pass at most.
pub(crate) const MAX_ROUNDS: usize = 8;
/// Changed pages few enough to copy while paused without another round
/// (1 MiB).
pub(crate) const DONE_PAGES: usize = 256;

/// A full snapshot's memory as the pre-copy left it before the pause.
pub(super) struct Precopy {
    /// The memory file in the staging directory.
    pub file: MemoryFile,
    /// Writes it.
    pub writer: MemoryWriter,
    /// Pages changed during the last round, not copied again yet.
    pub pending: PageSet,
    /// Rounds run, the first pass included.
    pub rounds: usize,
    /// Pages copied in all rounds.
    pub pages: usize,
    /// A buffer, faulted in, for the pages to copy while paused (a running
    /// VM whose changed pages fit in [`COPY_LIMIT`]).
    pub buffer: Option<Vec<u8>>,
}

impl Vm {
    /// Runs the pre-copy of a full snapshot into the staging directory
    /// `dir`; `running` says whether the guest runs meanwhile.
    pub(super) fn precopy(&mut self, dir: &Path, running: bool) -> Result<Precopy> {
        let file = MemoryFile::create(dir)?;
        let dup = file
            .file()
            .try_clone()
            .map_err(|e| Error::io("reopening the snapshot memory", e))?;
        let mut writer = MemoryWriter::new(dup, &self.ram)?;
        self.take_dirty()?;
        let mut pages = writer.copy_all(&self.ram)?;
        writer.write_back()?;
        let mut rounds = 1;
        let mut copied = usize::MAX;
        let mut pending = self.take_dirty()?;
        // The most pages the guest changed in one round: what it may change
        // again before the pause.
        let mut most = pending.count();
        while pending.count() > DONE_PAGES && pending.count() < copied && rounds <= MAX_ROUNDS {
            copied = writer.copy_set(&self.ram, &pending)?;
            pages += copied;
            rounds += 1;
            pending = self.take_dirty()?;
            most = most.max(pending.count());
        }
        let left = pending.count();
        // Faulted in now: growing it while paused costs a page fault per
        // page, which on a nested host is most of the pause.
        let buffer = (running && left * PAGE_SIZE <= COPY_LIMIT)
            .then(|| PageCopy::buffer((left + 2 * most + 64).min(COPY_LIMIT / PAGE_SIZE)));
        tracing::debug!(rounds, pages, left, "pre-copy");
        Ok(Precopy {
            file,
            writer,
            pending,
            rounds,
            pages,
            buffer,
        })
    }
}
