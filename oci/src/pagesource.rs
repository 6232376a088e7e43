//! The guest memory of a snapshot being pulled lazily, page by page: what a
//! VM restored from the leaf would have, composed from the chain's memory
//! layers as twig-vmm composes them (the root's memory, each incremental
//! layer's pages on top), each layer read from its file where the store has
//! it and by range from its blob in the registry where it does not.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;

use crate::client::Client;
use crate::error::{Error, Result};
use crate::extents::Index;
use crate::reference::Reference;

/// A guest page.
pub const PAGE: u64 = 4096;
/// Longest a range read may take, answer and body.
const RANGE_DEADLINE: Duration = Duration::from_secs(60);
/// Range reads a prefetch has in flight at once.
const PREFETCH_PARALLEL: usize = 4;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One memory layer of the chain.
pub(crate) struct Layer {
    /// The snapshot's id (for errors).
    pub id: String,
    /// An incremental layer's pages (bitmap words); `None`: the root, all.
    pub pages: Option<Vec<u64>>,
    pub backing: Backing,
}

impl Layer {
    fn holds(&self, page: u64) -> bool {
        match &self.pages {
            None => true,
            Some(w) => w
                .get((page / 64) as usize)
                .is_some_and(|x| x & (1 << (page % 64)) != 0),
        }
    }
}

/// Where a layer's bytes are.
pub(crate) enum Backing {
    /// Its memory file, in the store: guest-offset addressed.
    Local(Arc<File>),
    /// Its blob in the registry.
    Remote(Arc<Remote>),
}

/// A memory layer still in the registry: its verified index, the records
/// fetched by range (until the download has written them), and the file
/// the download decodes into.
pub(crate) struct Remote {
    pub digest: String,
    pub index: Arc<Index>,
    slots: Vec<Mutex<Option<Bytes>>>,
    /// Records a prefetch is reading (set and looked at under the
    /// record's slot lock): a fault waits for it rather than reading it
    /// again.
    prefetching: Vec<AtomicBool>,
    /// Records `0..decoded` are verified and written in `file`.
    decoded: AtomicUsize,
    file: OnceLock<File>,
}

impl Remote {
    pub fn new(digest: String, index: Index) -> Remote {
        Remote {
            digest,
            slots: (0..index.entries.len()).map(|_| Mutex::new(None)).collect(),
            prefetching: (0..index.entries.len())
                .map(|_| AtomicBool::new(false))
                .collect(),
            index: Arc::new(index),
            decoded: AtomicUsize::new(0),
            file: OnceLock::new(),
        }
    }

    /// The file the download decodes into (a handle of its own).
    pub fn decoding_into(&self, file: File) {
        let _ = self.file.set(file);
    }

    /// Record `i` is verified and written in the file: served from there.
    pub fn written(&self, i: usize) {
        self.decoded.store(i + 1, Ordering::Release);
        // Not waiting for a reader fetching it meanwhile: that reader
        // does not keep what it fetched.
        if let Some(s) = self.slots.get(i) {
            match s.try_lock() {
                Ok(mut g) => *g = None,
                Err(std::sync::TryLockError::Poisoned(p)) => *p.into_inner() = None,
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
    }

    fn local(&self, i: usize) -> Option<&File> {
        (self.decoded.load(Ordering::Acquire) > i)
            .then(|| self.file.get())
            .flatten()
    }
}

/// Where a [`PageSource`] fetches from.
pub(crate) struct Fetcher {
    pub client: Client,
    pub from: Reference,
    pub rt: tokio::runtime::Handle,
}

/// The composed guest memory of a lazily pulled snapshot's leaf. Blocking
/// (call it from a thread of its own, or `spawn_blocking`): ranges are
/// fetched on the runtime it was made on, each verified against its
/// layer's index before it is returned, and kept until the pull's download
/// has written it locally. Errors name the blob; a registry gone is an
/// error within the client's timeouts, never a hang.
pub struct PageSource {
    mem_size: u64,
    /// Root first.
    layers: Vec<Layer>,
    fetcher: Fetcher,
    fetched: AtomicU64,
    served: Mutex<Served>,
    /// Told whenever a prefetched record arrives (or its read failed):
    /// a read waiting for it looks again.
    arrived: (Mutex<()>, Condvar),
}

#[derive(Default)]
struct Served {
    seen: Vec<u64>,
    order: Vec<u64>,
}

impl PageSource {
    pub(crate) fn new(mem_size: u64, layers: Vec<Layer>, fetcher: Fetcher) -> PageSource {
        PageSource {
            mem_size,
            layers,
            fetcher,
            fetched: AtomicU64::new(0),
            served: Mutex::new(Served {
                seen: vec![0; (mem_size / PAGE).div_ceil(64) as usize],
                order: Vec::new(),
            }),
            arrived: (Mutex::new(()), Condvar::new()),
        }
    }

    pub(crate) fn remote(&self, layer: usize) -> Option<&Arc<Remote>> {
        match &self.layers.get(layer)?.backing {
            Backing::Remote(r) => Some(r),
            Backing::Local(_) => None,
        }
    }

    /// The guest's memory size in bytes.
    pub fn mem_size(&self) -> u64 {
        self.mem_size
    }

    /// The guest's memory size in pages.
    pub fn pages(&self) -> u64 {
        self.mem_size / PAGE
    }

    /// Bytes fetched by range from the registry so far (each range once).
    pub fn bytes_fetched(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    /// Pages in the order they were first read: the guest's hot pages,
    /// for a later restore to [`prefetch`](PageSource::prefetch).
    pub fn served(&self) -> Vec<u64> {
        lock(&self.served).order.clone()
    }

    /// The layer page `page` comes from (`None`: none, zero).
    fn layer_of(&self, page: u64) -> Option<usize> {
        self.layers.iter().rposition(|l| l.holds(page))
    }

    /// Whether page `page` is known to be zero without reading it: no
    /// record of its layer's blob carries it, or a hole of its layer's
    /// file (a node can map it with a zero page instead of copying).
    /// `false` means it may hold data.
    pub fn is_zero(&self, page: u64) -> bool {
        if page >= self.pages() {
            return false;
        }
        let Some(l) = self.layer_of(page) else {
            return true;
        };
        match &self.layers[l].backing {
            Backing::Remote(r) => r.index.find(page * PAGE).is_none(),
            Backing::Local(f) => is_hole(f, page * PAGE),
        }
    }

    /// Whether pages `first_page..first_page + n` read without a range
    /// read: each is in a layer the store has, in a record already fetched
    /// or written, or carried by no record (zero).
    pub fn is_cached(&self, first_page: u64, n: u64) -> bool {
        (first_page..first_page.saturating_add(n).min(self.pages())).all(|page| {
            let Some(l) = self.layer_of(page) else {
                return true;
            };
            match &self.layers[l].backing {
                Backing::Local(_) => true,
                Backing::Remote(r) => r
                    .index
                    .find(page * PAGE)
                    .is_none_or(|i| r.local(i).is_some() || lock(&r.slots[i]).is_some()),
            }
        })
    }

    /// Reads pages `first_page..` into `out` (a whole number of pages).
    pub fn read(&self, first_page: u64, out: &mut [u8]) -> Result<()> {
        let n = out.len() as u64 / PAGE;
        if out.len() as u64 % PAGE != 0 || first_page.saturating_add(n) > self.pages() {
            return Err(Error::Invalid(format!(
                "pages {first_page}+{} of a {}-page guest",
                out.len() as f64 / PAGE as f64,
                self.pages()
            )));
        }
        for (k, buf) in out.chunks_mut(PAGE as usize).enumerate() {
            let page = first_page + k as u64;
            match self.layer_of(page) {
                None => buf.fill(0),
                Some(l) => self.read_page(l, page, buf)?,
            }
        }
        let mut s = lock(&self.served);
        for page in first_page..first_page + n {
            let (w, b) = ((page / 64) as usize, 1u64 << (page % 64));
            if s.seen[w] & b == 0 {
                s.seen[w] |= b;
                s.order.push(page);
            }
        }
        Ok(())
    }

    fn read_page(&self, l: usize, page: u64, buf: &mut [u8]) -> Result<()> {
        let at = page * PAGE;
        let what = || format!("reading page {page} of snapshot {}", self.layers[l].id);
        let r = match &self.layers[l].backing {
            Backing::Local(f) => return f.read_exact_at(buf, at).map_err(Error::local(&what())),
            Backing::Remote(r) => r,
        };
        let Some(i) = r.index.find(at) else {
            buf.fill(0);
            return Ok(());
        };
        let e = &r.index.entries[i];
        let within = (at - e.offset) as usize;
        if let Some(f) = r.local(i) {
            return f.read_exact_at(buf, at).map_err(Error::local(&what()));
        }
        let mut waited = false;
        let data = loop {
            let mut slot = lock(&r.slots[i]);
            if let Some(d) = &*slot {
                break d.clone();
            }
            if let Some(f) = r.local(i) {
                return f.read_exact_at(buf, at).map_err(Error::local(&what()));
            }
            // Once: a prefetch that failed or never came back is read here.
            if !waited && r.prefetching[i].load(Ordering::Acquire) {
                drop(slot);
                self.wait_prefetch(r, i);
                waited = true;
                continue;
            }
            let d = self.block_on(fetch_record(
                self.fetcher.client.clone(),
                self.fetcher.from.clone(),
                r.clone(),
                i,
            ))?;
            let d = verified(r, i, d)?;
            self.fetched.fetch_add(d.len() as u64, Ordering::Relaxed);
            if r.local(i).is_none() {
                *slot = Some(d.clone());
            }
            break d;
        };
        // A record ends on a page boundary, or at the file's end.
        let n = (data.len() - within).min(buf.len());
        buf[..n].copy_from_slice(&data[within..within + n]);
        buf[n..].fill(0);
        Ok(())
    }

    /// Fetches the records holding `pages` that are neither local nor
    /// fetched yet, a few at a time, ahead of the faults that will want
    /// them (e.g. the [`served`](PageSource::served) order of an earlier
    /// restore of the same snapshot). A [`read`](PageSource::read) of a
    /// record being prefetched waits for it rather than reading it again;
    /// each record is verified here, not on the runtime the faults' reads
    /// need.
    pub fn prefetch(&self, pages: &[u64]) -> Result<()> {
        let mut want: Vec<(Arc<Remote>, usize)> = Vec::new();
        for &page in pages.iter().filter(|p| **p < self.pages()) {
            let Some(Backing::Remote(r)) = self.layer_of(page).map(|l| &self.layers[l].backing)
            else {
                continue;
            };
            let Some(i) = r.index.find(page * PAGE) else {
                continue;
            };
            if r.local(i).is_none()
                && lock(&r.slots[i]).is_none()
                && !want.iter().any(|(w, j)| Arc::ptr_eq(w, r) && *j == i)
            {
                want.push((r.clone(), i));
            }
        }
        if want.is_empty() {
            return Ok(());
        }
        let (client, from) = (self.fetcher.client.clone(), self.fetcher.from.clone());
        let jobs = want.clone();
        // Each record as it arrives, to this thread: verified, kept, and
        // the faults waiting for it told, while the others are on their way.
        let (tx, rx) = std::sync::mpsc::channel();
        self.fetcher.rt.spawn(async move {
            let permits = Arc::new(tokio::sync::Semaphore::new(PREFETCH_PARALLEL));
            let mut set = tokio::task::JoinSet::new();
            for (k, (r, i)) in jobs.into_iter().enumerate() {
                let (client, from, permits) = (client.clone(), from.clone(), permits.clone());
                set.spawn(async move {
                    let _permit = permits.acquire_owned().await;
                    // Not a record a fault is reading, or has read.
                    let claimed = match r.slots[i].try_lock() {
                        Ok(slot)
                            if slot.is_none()
                                && r.local(i).is_none()
                                && !r.prefetching[i].load(Ordering::Acquire) =>
                        {
                            r.prefetching[i].store(true, Ordering::Release);
                            true
                        }
                        _ => false,
                    };
                    if !claimed {
                        return (k, None);
                    }
                    (k, Some(fetch_record(client, from, r, i).await))
                });
            }
            while let Some(j) = set.join_next().await {
                if let Ok(got) = j {
                    let _ = tx.send(got);
                }
            }
        });
        let mut answered = vec![false; want.len()];
        let mut first_err = None;
        for (k, res) in rx {
            answered[k] = true;
            let Some(res) = res else {
                continue;
            };
            let (r, i) = &want[k];
            {
                let mut slot = lock(&r.slots[*i]);
                match res.and_then(|d| verified(r, *i, d)) {
                    Ok(d) => {
                        self.fetched.fetch_add(d.len() as u64, Ordering::Relaxed);
                        if slot.is_none() && r.local(*i).is_none() {
                            *slot = Some(d);
                        }
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
                r.prefetching[*i].store(false, Ordering::Release);
            }
            self.notify_arrived();
        }
        // A read that never came back (its task gone, or the runtime):
        // nothing is waited for.
        if answered.iter().any(|a| !a) {
            for ((r, i), _) in want.iter().zip(&answered).filter(|(_, a)| !**a) {
                r.prefetching[*i].store(false, Ordering::Release);
            }
            self.notify_arrived();
            first_err.get_or_insert(Error::Transfer(
                "the runtime fetching pages stopped before they arrived".into(),
            ));
        }
        first_err.map_or(Ok(()), Err)
    }

    fn notify_arrived(&self) {
        let _guard = lock(&self.arrived.0);
        self.arrived.1.notify_all();
    }

    /// Waits until record `i` of `r` is no longer being prefetched (at
    /// most [`RANGE_DEADLINE`]: the prefetch's read has that deadline too).
    fn wait_prefetch(&self, r: &Remote, i: usize) {
        let deadline = std::time::Instant::now() + RANGE_DEADLINE;
        let mut guard = lock(&self.arrived.0);
        while r.prefetching[i].load(Ordering::Acquire) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return;
            }
            guard = match self.arrived.1.wait_timeout(guard, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Runs `fut` on the source's runtime and waits for it.
    fn block_on<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.fetcher.rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().map_err(|_| {
            Error::Transfer("the runtime fetching pages stopped before they arrived".into())
        })?
    }
}

/// Record `i` of `r`'s blob, fetched by range (not yet verified: see
/// [`verified`]).
async fn fetch_record(client: Client, from: Reference, r: Arc<Remote>, i: usize) -> Result<Bytes> {
    let (start, len) = r.index.entries[i].data_range();
    tokio::time::timeout(
        RANGE_DEADLINE,
        client.blob_range(&from, &r.digest, start, len),
    )
    .await
    .map_err(|_| {
        Error::Transfer(format!(
            "blob {} bytes {start}+{len}: not there within {RANGE_DEADLINE:?}",
            r.digest
        ))
    })?
}

/// `data`, fetched for record `i` of `r`'s blob, if it matches the
/// SHA-256 the blob's verified index gives (checked by the caller's
/// thread: hashing on the runtime would hold up other reads).
fn verified(r: &Remote, i: usize, data: Bytes) -> Result<Bytes> {
    let e = r.index.entries[i];
    let (start, len) = e.data_range();
    if !e.verify(&data) {
        tracing::warn!(blob = %r.digest, start, len, "a fetched range does not match its index");
        return Err(Error::Corrupt(format!(
            "blob {}: record {i} (file bytes {}+{len}, blob bytes {start}+{len}) does not match \
             the SHA-256 its verified index gives",
            r.digest, e.offset
        )));
    }
    Ok(data)
}

/// Whether byte `at` of `f` is in a hole (reads as zero).
fn is_hole(f: &File, at: u64) -> bool {
    // SAFETY: lseek on a descriptor `f` owns; only its offset changes
    // (reads here are positional).
    let data = unsafe { libc::lseek(f.as_raw_fd(), at as libc::off_t, libc::SEEK_DATA) };
    if data < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
    }
    data as u64 >= at + PAGE
}
