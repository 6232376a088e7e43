//! The snapshot format.
//!
//! A snapshot is a directory holding:
//! - `state`: a 32-byte header (magic `TWIGSNAP`, format version, payload
//!   length, CRC32 of the payload) and a payload of length-prefixed sections
//!   in a fixed order: metadata (JSON, with the hot list: the pages the
//!   guest was using, what a lazy restore fetches first), irqchips, PIT,
//!   clock, devices, the page bitmap of an incremental snapshot, then each
//!   vCPU's state. Its size is capped so hostile files cannot make us
//!   allocate without bound.
//! - `memory`: a full snapshot holds all of guest RAM; an incremental one is a
//!   sparse file holding only the pages dirtied since its parent, each at its
//!   own offset. Its parent is named by id (and a random uid that catches a
//!   replaced parent) and found as a sibling directory, as the node store's
//!   layout (`twig_store::layout`) says, so a store moved elsewhere keeps its
//!   chains. A chain restores by mapping the root's memory and reading each
//!   layer's pages on top.
//! - `disk<i>` for each read-write disk `i` (in device order): the whole
//!   image as it was at the snapshot, a reflink of the VM's disk file where
//!   the filesystem can (`FICLONE`), a copy of its data otherwise. Every
//!   snapshot holds its own disks, incremental ones included. The metadata
//!   records each disk's size and whether it is read-only (read-only disks
//!   are not copied: the same image must be attached on restore). Disk
//!   slots follow the fixed disks; the metadata says which disks are slots
//!   and whether a file was attached (an empty slot has no copy).
//!
//! twig-vmm writes a snapshot into a staging directory the node store hands
//! out (`<store>/tmp/<lease>/<id>`, named by the snapshot's id): the files
//! above and the store's `manifest.json` (id, parent, kind, artefacts),
//! fsynced in one batch. Publishing (checks, labels, the atomic no-replace
//! rename into `<store>/snapshots/<id>`) is the store's job, so a writer
//! killed at any point leaves nothing published.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
};
use serde::{Deserialize, Serialize};
use zerocopy::{FromBytes, Immutable, IntoBytes};

use twig_store::Artefact;

use crate::error::{Error, Result};
use crate::memory::{GuestRam, PageSet, PAGE_SIZE};
use crate::vcpu::{self, VcpuState};

/// File magic.
pub const MAGIC: [u8; 8] = *b"TWIGSNAP";
/// The format version this build writes and reads.
pub const VERSION: u32 = 3;
/// Largest `state` file accepted.
pub const MAX_STATE_BYTES: u64 = 64 << 20;
/// Longest chain of incremental snapshots followed.
pub const MAX_CHAIN: usize = 1024;
const HEADER_LEN: usize = 32;

/// Full or incremental.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// All of guest RAM.
    Full,
    /// Only the pages dirtied since the parent.
    Incremental,
}

/// A snapshot's parent: a sibling directory named by its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParentRef {
    /// The parent's id (its directory's name in the store).
    pub id: String,
    /// The parent's uid, which a snapshot published later under the same id
    /// would not have.
    pub uid: String,
}

/// Snapshot metadata (the JSON section).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    /// The snapshot's id in its store (its directory's name).
    pub id: String,
    /// Random unique id (128 bits, hex), never reused.
    pub uid: String,
    /// Full or incremental.
    pub kind: Kind,
    /// The parent of an incremental snapshot.
    pub parent: Option<ParentRef>,
    /// The uid of the full snapshot at the root of the chain (its own uid
    /// if full): snapshots of one VM lineage share it.
    pub root_id: String,
    /// Guest RAM size in bytes.
    pub mem_size: u64,
    /// Number of vCPUs.
    pub vcpus: usize,
    /// Pages held in `memory` (all of them for a full snapshot).
    pub pages: usize,
    /// CRC32 of the pages held in `memory`, in page order.
    pub memory_crc: u32,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The VM's disks, in device order.
    #[serde(default)]
    pub disks: Vec<DiskMeta>,
    /// The pages the guest was using when the snapshot was taken, as runs
    /// `(first page, count)` in ascending order (at most [`MAX_HOT_RUNS`],
    /// coarsened to 64 KiB or more): what a lazy restore fetches first.
    /// A hint: empty when unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hot: Vec<(u64, u64)>,
}

/// Most runs a snapshot's [`Meta::hot`] list holds.
pub const MAX_HOT_RUNS: usize = 1024;

/// Checks a hot list read from a snapshot: at most [`MAX_HOT_RUNS`]
/// non-empty, ascending, non-overlapping runs inside `pages` pages.
fn check_hot(hot: &[(u64, u64)], pages: u64) -> std::result::Result<(), String> {
    if hot.len() > MAX_HOT_RUNS {
        return Err(format!("{} hot runs (at most {MAX_HOT_RUNS})", hot.len()));
    }
    let mut end = 0;
    for &(first, n) in hot {
        let inside = first.checked_add(n).is_some_and(|e| e <= pages);
        if n == 0 || first < end || !inside {
            return Err(format!(
                "hot run {first}+{n} is empty, out of order or outside {pages} pages"
            ));
        }
        end = first + n;
    }
    Ok(())
}

/// A disk of a snapshotted VM: a fixed disk, or a disk slot (empty, or
/// with a file attached).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskMeta {
    /// Read-only disks are not copied into the snapshot.
    pub read_only: bool,
    /// The image's size in bytes (0 for an empty slot).
    pub size: u64,
    /// Whether this is a disk slot rather than a fixed disk.
    #[serde(default)]
    pub slot: bool,
    /// Whether an image was attached (always, for a fixed disk).
    #[serde(default = "attached_default")]
    pub attached: bool,
}

fn attached_default() -> bool {
    true
}

impl DiskMeta {
    /// Whether the snapshot holds a copy of this disk (`disk<i>`): it had a
    /// read-write image attached.
    pub fn has_copy(&self) -> bool {
        self.attached && !self.read_only
    }
}

/// The name of read-write disk `index`'s copy in a snapshot directory.
pub fn disk_file_name(index: usize) -> String {
    twig_store::Artefact::Disk(index).file_name()
}

/// Everything in a `state` file.
#[derive(Clone)]
pub struct VmState {
    /// What the snapshot is: id, kind, parent, shape, disks.
    pub meta: Meta,
    /// The PIC master, PIC slave and IOAPIC.
    pub irqchips: [kvm_irqchip; 3],
    /// The PIT.
    pub pit: kvm_pit_state2,
    /// The KVM clock.
    pub clock: kvm_clock_data,
    /// Every device's state, as `Devices::save` wrote it.
    pub devices: Vec<u8>,
    /// Pages held by an incremental snapshot.
    pub layer: Option<PageSet>,
    /// Each vCPU's state, in vCPU order.
    pub vcpus: Vec<VcpuState>,
}

struct Writer(Vec<u8>);

impl Writer {
    fn blob(&mut self, b: &[u8]) {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
    }
    fn pod<T: IntoBytes + Immutable>(&mut self, v: &T) {
        self.blob(v.as_bytes());
    }
    fn pods<T: IntoBytes + Immutable>(&mut self, v: &[T]) {
        self.blob(v.as_bytes());
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, what: &str) -> Error {
        Error::snapshot(self.path, format!("state file is malformed at {what}"))
    }
    fn blob(&mut self, what: &str) -> Result<&'a [u8]> {
        if self.buf.len() < 4 {
            return Err(self.err(what));
        }
        let n = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        let rest = &self.buf[4..];
        if rest.len() < n {
            return Err(self.err(what));
        }
        self.buf = &rest[n..];
        Ok(&rest[..n])
    }
    fn pod<T: FromBytes>(&mut self, what: &str) -> Result<T> {
        let b = self.blob(what)?;
        T::read_from_bytes(b).map_err(|_| self.err(what))
    }
    fn pods<T: FromBytes>(&mut self, what: &str, max: usize) -> Result<Vec<T>> {
        let b = self.blob(what)?;
        let size = std::mem::size_of::<T>();
        if b.len() % size != 0 || b.len() / size > max {
            return Err(self.err(what));
        }
        b.chunks_exact(size)
            .map(|c| T::read_from_bytes(c).map_err(|_| self.err(what)))
            .collect()
    }
    /// A vCPU's XSAVE area: at least the legacy area and its header, which
    /// every KVM reads (see [`vcpu::XSAVE_MIN_WORDS`]).
    fn xsave(&mut self, what: &str) -> Result<Vec<u32>> {
        let words = self.pods::<u32>(what, 1 << 16)?;
        if words.len() < vcpu::XSAVE_MIN_WORDS {
            return Err(Error::snapshot(
                self.path,
                format!(
                    "{what} area is {} bytes, shorter than the {} bytes of the legacy area and its header",
                    words.len() * 4,
                    vcpu::XSAVE_MIN_WORDS * 4
                ),
            ));
        }
        Ok(words)
    }
}

impl VmState {
    /// Serializes to the bytes of a `state` file (header included).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut w = Writer(Vec::with_capacity(64 * 1024));
        let meta = serde_json::to_vec(&self.meta)
            .map_err(|e| Error::Config(format!("encoding snapshot metadata: {e}")))?;
        w.blob(&meta);
        for chip in &self.irqchips {
            w.pod(chip);
        }
        w.pod(&self.pit);
        w.pod(&self.clock);
        w.blob(&self.devices);
        match &self.layer {
            Some(l) => w.pods(l.words()),
            None => w.blob(&[]),
        }
        for v in &self.vcpus {
            w.pods(&v.cpuid);
            w.pod(&v.mp_state);
            w.pod(&v.regs);
            w.pod(&v.sregs);
            w.pods(&v.xsave);
            w.pod(&v.xcrs);
            w.pod(&v.debugregs);
            w.pod(&v.lapic);
            w.pods(&v.msrs);
            w.pod(&v.events);
            w.pod(&v.tsc_khz);
        }
        let payload = w.0;
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&payload);
        Ok(out)
    }

    /// Parses and validates the bytes of a `state` file read from `path`.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<VmState> {
        let bad = |reason: String| Error::snapshot(path, reason);
        if bytes.len() < HEADER_LEN {
            return Err(bad(format!(
                "state file is truncated ({} bytes, header needs {HEADER_LEN})",
                bytes.len()
            )));
        }
        if bytes[..8] != MAGIC {
            return Err(bad("not a twig snapshot (bad magic)".into()));
        }
        let u32_at =
            |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!(
                "snapshot format version {version} is not supported (this twig-vmm reads version {VERSION})"
            )));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[16..24]);
        let len = u64::from_le_bytes(len);
        let payload = &bytes[HEADER_LEN..];
        if len != payload.len() as u64 {
            return Err(bad(format!(
                "state file is truncated or padded: header says {len} payload bytes, file has {}",
                payload.len()
            )));
        }
        let crc = u32_at(24);
        let actual = crc32fast::hash(payload);
        if crc != actual {
            return Err(bad(format!(
                "state file is corrupted (CRC32 {actual:#010x}, expected {crc:#010x})"
            )));
        }
        let mut r = Reader { buf: payload, path };
        let meta: Meta = serde_json::from_slice(r.blob("metadata")?)
            .map_err(|e| bad(format!("metadata: {e}")))?;
        if meta.mem_size == 0 || meta.mem_size % PAGE_SIZE as u64 != 0 {
            return Err(bad(format!(
                "memory size {} is not page-aligned",
                meta.mem_size
            )));
        }
        if meta.vcpus == 0 || meta.vcpus > crate::vm::MAX_VCPUS {
            return Err(bad(format!("{} vCPUs is out of range", meta.vcpus)));
        }
        let pages = (meta.mem_size / PAGE_SIZE as u64) as usize;
        check_hot(&meta.hot, pages as u64).map_err(bad)?;
        let irqchips = [
            r.pod("irqchip 0")?,
            r.pod("irqchip 1")?,
            r.pod("irqchip 2")?,
        ];
        let pit = r.pod("PIT")?;
        let clock = r.pod("clock")?;
        let devices = r.blob("devices")?.to_vec();
        let words: Vec<u64> = r.pods("page bitmap", pages.div_ceil(64))?;
        let layer = match meta.kind {
            Kind::Full => {
                if !words.is_empty() || meta.parent.is_some() {
                    return Err(bad("a full snapshot with a page bitmap or parent".into()));
                }
                None
            }
            Kind::Incremental => {
                if words.len() != pages.div_ceil(64) || meta.parent.is_none() {
                    return Err(bad(
                        "an incremental snapshot without page bitmap or parent".into()
                    ));
                }
                let set = PageSet::from_words(words, pages);
                if set.count() != meta.pages {
                    return Err(bad(format!(
                        "page bitmap holds {} pages, metadata says {}",
                        set.count(),
                        meta.pages
                    )));
                }
                Some(set)
            }
        };
        let mut vcpus = Vec::with_capacity(meta.vcpus);
        for i in 0..meta.vcpus {
            let what = |s: &str| format!("vCPU {i} {s}");
            vcpus.push(VcpuState {
                cpuid: r.pods::<kvm_cpuid_entry2>(
                    &what("CPUID"),
                    kvm_bindings::KVM_MAX_CPUID_ENTRIES,
                )?,
                mp_state: r.pod::<kvm_mp_state>(&what("MP state"))?,
                regs: r.pod::<kvm_regs>(&what("registers"))?,
                sregs: r.pod::<kvm_sregs>(&what("special registers"))?,
                xsave: r.xsave(&what("XSAVE"))?,
                xcrs: r.pod::<kvm_xcrs>(&what("XCRs"))?,
                debugregs: r.pod::<kvm_debugregs>(&what("debug registers"))?,
                lapic: r.pod::<kvm_lapic_state>(&what("LAPIC"))?,
                msrs: r.pods::<kvm_msr_entry>(&what("MSRs"), 4096)?,
                events: r.pod::<kvm_vcpu_events>(&what("events"))?,
                tsc_khz: r.pod::<u32>(&what("TSC frequency"))?,
            });
        }
        if !r.buf.is_empty() {
            return Err(bad(format!(
                "{} unexpected bytes after the last vCPU",
                r.buf.len()
            )));
        }
        Ok(VmState {
            meta,
            irqchips,
            pit,
            clock,
            devices,
            layer,
            vcpus,
        })
    }
}

fn io_err(path: &Path, what: &str) -> impl Fn(std::io::Error) -> Error {
    let path = path.to_path_buf();
    let what = what.to_string();
    move |e| Error::snapshot(&path, format!("{what}: {e}"))
}

/// Reads and validates the `state` file of the snapshot in `dir`.
pub fn read_state(dir: &Path) -> Result<VmState> {
    let path = dir.join(Artefact::State.file_name());
    let mut f = File::open(&path).map_err(io_err(dir, "cannot open the state file"))?;
    let len = f
        .metadata()
        .map_err(io_err(dir, "cannot stat the state file"))?
        .len();
    if len > MAX_STATE_BYTES {
        return Err(Error::snapshot(
            dir,
            format!("state file is {len} bytes, over the {MAX_STATE_BYTES}-byte limit"),
        ));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    f.read_to_end(&mut bytes)
        .map_err(io_err(dir, "cannot read the state file"))?;
    VmState::decode(&bytes, &path)
}

/// A new random snapshot id (128 bits, hex).
pub fn new_id() -> String {
    let mut b = [0u8; 16];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b = (t ^ u128::from(std::process::id()) << 64).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Asks the kernel to start writing `f` back without waiting.
fn start_writeback(f: &File) {
    // SAFETY: sync_file_range on an open fd; failure only loses the hint.
    unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
}

/// A snapshot written into its staging directory, not yet durable. The VM
/// can run again once it is staged: its pages are in the page cache,
/// copied. Dropping it without [`Staged::commit`] removes what it wrote, so
/// a failed snapshot leaves an empty staging directory.
pub struct Staged {
    dir: PathBuf,
    /// Id, parent id and kind, for the store's manifest.
    lineage: (String, Option<String>, twig_store::Kind),
    memory: File,
    state: File,
    disks: Vec<File>,
    written: Written,
}

/// Files written into a staging directory, removed on drop unless kept.
#[derive(Default)]
struct Written {
    paths: Vec<PathBuf>,
    keep: bool,
}

impl Written {
    /// Creates the new file `name` in `dir` (never overwriting one) and
    /// remembers it.
    fn create(&mut self, dir: &Path, name: &str) -> Result<File> {
        let path = dir.join(name);
        let f = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_err(
                dir,
                &format!("cannot create {name} in the staging directory"),
            ))?;
        self.paths.push(path);
        Ok(f)
    }
}

impl Drop for Written {
    fn drop(&mut self) {
        if !self.keep {
            for p in &self.paths {
                if let Err(e) = std::fs::remove_file(p) {
                    tracing::warn!("removing {} of a failed snapshot: {e}", p.display());
                }
            }
        }
    }
}

/// A snapshot begun in its staging directory: its disk copies are there,
/// its memory and state are not yet. Dropping it removes what it wrote.
pub struct Staging {
    dir: PathBuf,
    disks: Vec<File>,
    memory: Option<File>,
    written: Written,
}

/// A snapshot's memory file, created in its staging directory before the
/// rest of the snapshot (a full snapshot's pre-copy writes it while the
/// guest runs). Dropped without being passed to [`begin`], it is removed.
pub struct MemoryFile {
    file: File,
    written: Written,
}

impl MemoryFile {
    /// Creates the (empty) memory file in the staging directory `dir`.
    pub fn create(dir: &Path) -> Result<MemoryFile> {
        let mut written = Written::default();
        let file = written.create(dir, &Artefact::Memory.file_name())?;
        Ok(MemoryFile { file, written })
    }

    /// The file.
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// Begins a snapshot in `dir`, an existing staging directory handed out by
/// the node store and named by the snapshot's id, with the part that must
/// be taken while the vCPUs are parked besides their state and pages: each
/// `(index, file)` of `disks` is copied (reflinked where possible) to
/// `disk<index>`, and must have the size `state.meta.disks[index]` records.
/// [`Staging::finish`] then writes memory and state. A `memory` file made
/// beforehand becomes the snapshot's.
pub fn begin(
    dir: &Path,
    state: &VmState,
    disks: &[(usize, &File)],
    memory: Option<MemoryFile>,
) -> Result<Staging> {
    let mut written = Written::default();
    let memory = memory.map(|mut m| {
        written.paths.append(&mut m.written.paths);
        m.file
    });
    let mut copies = Vec::with_capacity(disks.len());
    for &(index, src) in disks {
        let dst = written.create(dir, &disk_file_name(index))?;
        copy_disk(dir, state, index, src, &dst)?;
        copies.push(dst);
    }
    Ok(Staging {
        dir: dir.to_path_buf(),
        disks: copies,
        memory,
        written,
    })
}

impl Staging {
    /// Writes the memory file: `write_memory` fills it (created empty, or
    /// the one [`begin`] was given) and returns the CRC32 of the whole
    /// file's pages held, which goes into the state's metadata; then writes
    /// the state.
    pub fn finish(
        mut self,
        state: &mut VmState,
        write_memory: impl FnOnce(&File) -> Result<u32>,
    ) -> Result<Staged> {
        let dir = self.dir;
        let meta = &state.meta;
        let lineage = (
            meta.id.clone(),
            meta.parent.as_ref().map(|p| p.id.clone()),
            match meta.kind {
                Kind::Full => twig_store::Kind::Full,
                Kind::Incremental => twig_store::Kind::Incremental,
            },
        );
        let memory = match self.memory.take() {
            Some(m) => m,
            None => self.written.create(&dir, &Artefact::Memory.file_name())?,
        };
        state.meta.memory_crc = write_memory(&memory)?;
        let bytes = state.encode()?;
        let mut f = self.written.create(&dir, &Artefact::State.file_name())?;
        f.write_all(&bytes)
            .map_err(io_err(&dir, "cannot write the state file"))?;
        Ok(Staged {
            dir,
            lineage,
            memory,
            state: f,
            disks: self.disks,
            written: self.written,
        })
    }
}

fn copy_disk(dir: &Path, state: &VmState, index: usize, src: &File, dst: &File) -> Result<()> {
    let name = disk_file_name(index);
    let expected = match state.meta.disks.get(index) {
        Some(d) if d.has_copy() => d.size,
        _ => {
            return Err(Error::snapshot(
                dir,
                format!("{name} is not a read-write disk of this VM"),
            ))
        }
    };
    twig_store::fsops::copy_file(src, dst)
        .map_err(io_err(dir, &format!("cannot copy the disk into {name}")))?;
    let size = dst
        .metadata()
        .map_err(io_err(dir, &format!("cannot stat {name}")))?
        .len();
    if size != expected {
        return Err(Error::snapshot(
            dir,
            format!("{name} is {size} bytes after copying, the disk {expected} bytes"),
        ));
    }
    Ok(())
}

impl Staged {
    /// The staged memory file.
    pub fn memory(&self) -> &File {
        &self.memory
    }

    /// Makes the snapshot durable and ready for the store to publish: the
    /// store's manifest is written last, then writeback of every file is
    /// started together and waited for (one journal commit covers them on a
    /// journaling filesystem). The directory's entries become durable with
    /// the store's rename (see `twig_store::Manifest`). Returns the memory
    /// file.
    pub fn commit(mut self) -> Result<File> {
        let dir = self.dir.clone();
        let (id, parent, kind) = &self.lineage;
        let bytes = twig_store::Manifest::of_staging(&dir, id, parent.as_deref(), *kind)
            .and_then(|m| m.to_bytes())
            .map_err(|e| Error::snapshot(&dir, e.to_string()))?;
        let mut manifest = self.written.create(&dir, twig_store::layout::MANIFEST)?;
        manifest
            .write_all(&bytes)
            .map_err(io_err(&dir, "cannot write the manifest"))?;
        start_writeback(&self.memory);
        start_writeback(&self.state);
        self.disks.iter().for_each(start_writeback);
        start_writeback(&manifest);
        // The fsyncs run side by side, so they share journal commits and
        // device flushes instead of paying one after another.
        let mut files = vec![
            (&self.memory, "cannot fsync the memory file"),
            (&self.state, "cannot fsync the state file"),
            (&manifest, "cannot fsync the manifest"),
        ];
        files.extend(self.disks.iter().map(|d| (d, "cannot fsync a disk copy")));
        std::thread::scope(|scope| {
            let others: Vec<_> = files[1..]
                .iter()
                .map(|&(f, what)| scope.spawn(move || f.sync_all().map_err(|e| (what, e))))
                .collect();
            let (f, what) = files[0];
            let mut result = f.sync_all().map_err(|e| (what, e));
            for h in others {
                let r = h.join().unwrap_or_else(|_| {
                    Err(("an fsync thread panicked", std::io::Error::other("panic")))
                });
                result = result.and(r);
            }
            result
        })
        .map_err(|(what, e)| io_err(&dir, what)(e))?;
        self.written.keep = true;
        self.memory
            .try_clone()
            .map_err(io_err(&dir, "cannot reopen the memory file"))
    }
}

/// Writes all of guest RAM into `file`; returns its CRC32. The VM must be
/// paused for the file to hold one moment's memory.
pub fn write_full_memory(ram: &GuestRam, file: &File) -> Result<u32> {
    write_pages(ram, &[(0, ram.pages())], file)
}

/// Writes the pages of `set` into `file` at their own offsets (a sparse file
/// of RAM size); returns the CRC32 of those pages in page order. The VM must
/// be paused for the file to hold one moment's memory.
pub fn write_layer_memory(ram: &GuestRam, set: &PageSet, file: &File) -> Result<u32> {
    file.set_len(ram.size() as u64)
        .map_err(|e| Error::io("sizing the snapshot memory file", e))?;
    write_pages(ram, &set.runs(), file)
}

/// Copies the page runs `(first, count)` of guest RAM out (in chunks, see
/// [`GuestRam::copy_out`]) into `file` at their own offsets; returns the
/// CRC32 of what it wrote, in order.
fn write_pages(ram: &GuestRam, runs: &[(usize, usize)], file: &File) -> Result<u32> {
    let mut crc = crc32fast::Hasher::new();
    for &(start, n) in runs {
        ram.copy_out(start, n, |off, bytes| {
            crc.update(bytes);
            std::os::unix::fs::FileExt::write_all_at(file, bytes, off)
                .map_err(|e| Error::io("writing guest memory to the snapshot", e))
        })?;
    }
    Ok(crc.finalize())
}

/// Faults the pages of `buf` in, writable: with one
/// `madvise(MADV_POPULATE_WRITE)` (Linux 5.14), not a page fault per page
/// (each an exit on a nested host: faulting in the buffer of 1,000 pages
/// one by one took longer than copying them); by writing each page where
/// the kernel lacks it.
fn populate(buf: &mut [u8]) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let start = buf.as_mut_ptr() as usize;
    let first = start.next_multiple_of(PAGE_SIZE);
    let end = (start + buf.len()) & !(PAGE_SIZE - 1);
    // SAFETY: [first, end) lies within `buf`, which this function borrows
    // mutably; populating leaves its contents as they are.
    let done = end > first
        && unsafe { libc::madvise(first as *mut libc::c_void, end - first, MADV_POPULATE_WRITE) }
            == 0;
    if !done {
        for b in buf.iter_mut().step_by(PAGE_SIZE) {
            // SAFETY: `b` is a valid, exclusively borrowed byte; volatile,
            // so that writing the zero it holds is not optimized away.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

/// Guest pages copied out of RAM into memory the VMM owns, so that a
/// snapshot's memory file can be written after the guest runs again.
pub struct PageCopy {
    runs: Vec<(usize, usize)>,
    bytes: Vec<u8>,
}

impl PageCopy {
    /// A buffer for `pages` pages, its memory faulted in now (so that
    /// [`PageCopy::take`] into it later only copies).
    pub fn buffer(pages: usize) -> Vec<u8> {
        // Zeroes are fresh, untouched pages (calloc): fault them in.
        let mut bytes = vec![0u8; pages * PAGE_SIZE];
        populate(&mut bytes);
        bytes
    }

    /// Copies the pages of `set` out of guest RAM (the VM must be paused
    /// for them to be one moment's memory) into `bytes`, resized to exactly
    /// their size (see [`PageCopy::buffer`]).
    pub fn take(ram: &GuestRam, set: &PageSet, mut bytes: Vec<u8>) -> Result<PageCopy> {
        let runs = set.runs();
        bytes.resize(set.count() * PAGE_SIZE, 0);
        let mut at = 0;
        for &(start, n) in &runs {
            let len = n * PAGE_SIZE;
            ram.read_pages(start, n, &mut bytes[at..at + len])?;
            at += len;
        }
        Ok(PageCopy { runs, bytes })
    }

    /// The copied pages, each with its page number.
    pub fn pages(&self) -> impl Iterator<Item = (usize, &[u8])> + '_ {
        self.runs
            .iter()
            .flat_map(|&(start, n)| start..start + n)
            .zip(self.bytes.chunks_exact(PAGE_SIZE))
    }

    /// The number of pages copied.
    pub fn count(&self) -> usize {
        self.bytes.len() / PAGE_SIZE
    }

    /// Writes the copied pages into `file` at their own offsets, as
    /// [`write_layer_memory`] does from guest RAM (a sparse file of
    /// `ram_size` bytes); returns the CRC32 of those pages in page order.
    pub fn write(&self, ram_size: usize, file: &File) -> Result<u32> {
        file.set_len(ram_size as u64)
            .map_err(|e| Error::io("sizing the snapshot memory file", e))?;
        let mut crc = crc32fast::Hasher::new();
        let mut at = 0;
        for &(start, n) in &self.runs {
            let len = n * PAGE_SIZE;
            let bytes = &self.bytes[at..at + len];
            crc.update(bytes);
            std::os::unix::fs::FileExt::write_all_at(file, bytes, (start * PAGE_SIZE) as u64)
                .map_err(|e| Error::io("writing guest memory to the snapshot", e))?;
            at += len;
        }
        Ok(crc.finalize())
    }
}

/// A snapshot opened for restore or rollback, with its ancestors.
pub struct Image {
    /// Its directory.
    pub dir: PathBuf,
    /// Its state.
    pub state: VmState,
    /// Its memory file.
    pub memory: Arc<File>,
    /// Its parent, for an incremental snapshot.
    pub parent: Option<Arc<Image>>,
}

impl Image {
    /// Opens the snapshot in `dir` and its whole chain, checking every link:
    /// ids, sizes, and each layer's page checksum.
    pub fn open(dir: &Path) -> Result<Arc<Image>> {
        Self::open_depth(dir, 0)
    }

    fn open_depth(dir: &Path, depth: usize) -> Result<Arc<Image>> {
        if depth > MAX_CHAIN {
            return Err(Error::snapshot(
                dir,
                format!("chain of incremental snapshots is longer than {MAX_CHAIN}"),
            ));
        }
        let state = read_state(dir)?;
        let memory = File::open(dir.join(Artefact::Memory.file_name()))
            .map_err(io_err(dir, "cannot open the memory file"))?;
        let size = memory
            .metadata()
            .map_err(io_err(dir, "cannot stat the memory file"))?
            .len();
        if size != state.meta.mem_size {
            return Err(Error::snapshot(
                dir,
                format!(
                    "memory file is {size} bytes but the snapshot's guest RAM is {} bytes (truncated or mismatched)",
                    state.meta.mem_size
                ),
            ));
        }
        check_disks(dir, &state.meta)?;
        let parent = match &state.meta.parent {
            None => None,
            Some(p) => {
                let pdir = twig_store::layout::parent_dir(dir, &p.id)
                    .map_err(|e| Error::snapshot(dir, format!("parent: {e}")))?;
                let parent = Self::open_depth(&pdir, depth + 1)?;
                let theirs = &parent.state.meta;
                if theirs.id != p.id || theirs.uid != p.uid {
                    return Err(Error::snapshot(
                        dir,
                        format!(
                            "parent {} is snapshot {} (uid {}), expected {} (uid {}): replaced",
                            pdir.display(),
                            theirs.id,
                            theirs.uid,
                            p.id,
                            p.uid
                        ),
                    ));
                }
                if theirs.mem_size != state.meta.mem_size || theirs.root_id != state.meta.root_id {
                    return Err(Error::snapshot(dir, "parent belongs to another VM lineage"));
                }
                Some(parent)
            }
        };
        if let Some(layer) = &state.layer {
            check_crc(
                dir,
                "memory pages",
                &memory,
                &layer.runs(),
                state.meta.memory_crc,
            )?;
        }
        Ok(Arc::new(Image {
            dir: dir.to_path_buf(),
            state,
            memory: Arc::new(memory),
            parent,
        }))
    }

    /// The chain from the root (full snapshot) to this one.
    pub fn chain(self: &Arc<Image>) -> Vec<Arc<Image>> {
        let mut v = vec![self.clone()];
        while let Some(p) = v.last().and_then(|i| i.parent.clone()) {
            v.push(p);
        }
        v.reverse();
        v
    }

    /// The path of read-write disk `index`'s copy.
    pub fn disk_path(&self, index: usize) -> PathBuf {
        self.dir.join(disk_file_name(index))
    }

    /// The snapshot's id.
    pub fn id(&self) -> &str {
        &self.state.meta.id
    }

    /// The newest snapshot in this chain that holds `page` in its own layer;
    /// `None` means the root's memory file.
    pub fn layer_for(self: &Arc<Image>, page: usize) -> Option<Arc<Image>> {
        let mut cur = Some(self.clone());
        while let Some(img) = cur {
            match &img.state.layer {
                Some(l) if l.contains(page) => return Some(img),
                Some(_) => cur = img.parent.clone(),
                None => return None,
            }
        }
        None
    }
}

/// Checks that every read-write disk's copy is there with its recorded size.
fn check_disks(dir: &Path, meta: &Meta) -> Result<()> {
    for (i, d) in meta.disks.iter().enumerate() {
        if !d.has_copy() {
            continue;
        }
        let name = disk_file_name(i);
        let size = std::fs::metadata(dir.join(&name))
            .map_err(io_err(dir, &format!("cannot stat the disk copy {name}")))?
            .len();
        if size != d.size {
            return Err(Error::snapshot(
                dir,
                format!(
                    "{name} is {size} bytes but the snapshot's disk {i} was {} bytes (truncated or replaced)",
                    d.size
                ),
            ));
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes at `offset`.
pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

/// Checks the CRC32 of the pages `runs` (`(first, count)`) of `file`.
fn check_crc(
    dir: &Path,
    what: &str,
    file: &File,
    runs: &[(usize, usize)],
    expected: u32,
) -> Result<()> {
    const CHUNK: usize = 256;
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; CHUNK * PAGE_SIZE];
    for &(start, n) in runs {
        let mut done = 0;
        while done < n {
            let k = CHUNK.min(n - done);
            let b = &mut buf[..k * PAGE_SIZE];
            read_exact_at(file, b, ((start + done) * PAGE_SIZE) as u64)
                .map_err(io_err(dir, "cannot read the memory file"))?;
            crc.update(b);
            done += k;
        }
    }
    let actual = crc.finalize();
    if actual != expected {
        return Err(Error::snapshot(
            dir,
            format!("{what} are corrupted (CRC32 {actual:#010x}, expected {expected:#010x})"),
        ));
    }
    Ok(())
}

/// Checks a snapshot end to end, including the CRC of a full snapshot's
/// memory (which restore does not read, as it maps memory lazily) and, for
/// every snapshot of the chain, each disk copy's presence and size.
pub fn verify(dir: &Path) -> Result<Meta> {
    let img = Image::open(dir)?;
    for i in img.chain() {
        let m = &i.state.meta;
        if m.kind == Kind::Full {
            let pages = (m.mem_size / PAGE_SIZE as u64) as usize;
            check_crc(
                &i.dir,
                "memory contents",
                &i.memory,
                &[(0, pages)],
                m.memory_crc,
            )?;
        }
    }
    Ok(img.state.meta.clone())
}
