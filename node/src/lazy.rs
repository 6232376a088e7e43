//! Lazy restores: a VM restored from a snapshot this node is still pulling.
//! The pull ([`twig_oci::lazy`]) has staged the snapshot's state and disks;
//! its memory arrives in the background. The node serves the VM's guest
//! memory meanwhile: the shim connects the VMM to the page server's socket
//! made here ([`serve`]) and twig-vmm sends it its userfaultfd
//! ([`twig_vmm::uffd`]); each page the guest first touches is read from the
//! pull's page source (by range from the registry, or what has arrived)
//! and copied in. The pages the snapshot's guest was using when it was
//! taken (its hot list) are fetched from the registry from the moment the
//! pull is staged, while the VMM restores, and copied in as they arrive
//! whenever no fault waits: never ahead of a fault. Once the pull has
//! published the snapshot, every page not yet touched is copied in, and
//! the VMM is told its memory is complete.
//!
//! A page source that fails (the registry gone, a corrupt range) or a pull
//! that cannot finish ends the page server's connection: the VMM, whose
//! vCPUs could otherwise wait for a page for ever, exits and the pod is
//! reported failed.

use std::num::NonZeroU64;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use twig_oci::lazy::{LazyPull, PageSource};
use twig_vmm::uffd::PageServer;

use crate::error::{Error, Result};

/// Pages read and copied in for one fault: the faulting page's aligned
/// 64 KiB (a guest touching a page soon touches its neighbours).
const FAULT_WINDOW: u64 = 16;
/// Pages copied in at once after the pull finished.
const FILL_CHUNK: u64 = 256;
/// How long the page server waits for its VMM to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the serving thread looks at the pull between faults.
const POLL: Duration = Duration::from_millis(20);
/// How often it looks whether the next hot chunk has arrived.
const HOT_POLL: Duration = Duration::from_millis(2);

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Starts serving `pull`'s memory to the VMM that connects to the socket
/// returned (under `run_dir/lazy/`), on a thread of its own; once it has
/// connected, the pull finishes on `rt`, downloading at most `pace` bytes
/// a second. `sandbox` names it in logs.
pub fn serve(
    run_dir: &Path,
    sandbox: &str,
    pull: LazyPull,
    pace: Option<NonZeroU64>,
    rt: tokio::runtime::Handle,
) -> Result<PathBuf> {
    // Root's alone: whoever connects first gets the guest's memory.
    let dir = run_dir.join("lazy");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let socket = dir.join(format!(
        "{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    // A leftover of an earlier daemon of the same pid.
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket)
        .map_err(|e| Error::io(format!("listening on {}", socket.display()), e))?;
    let source = pull.source.clone();
    let id = pull.id.clone();
    let stop = Arc::new(AtomicBool::new(false));
    prefetch_hot(&source, &pull.hot, &id, stop.clone())?;
    let path = socket.clone();
    let sandbox = sandbox.to_string();
    std::thread::Builder::new()
        .name(format!("lazy-{id}"))
        .spawn(move || {
            let outcome = accept(&listener).and_then(|conn| run(conn, &source, pull, pace, &rt));
            // A failed restore needs nothing more; after a complete one
            // what is left of the list is local, and its fetch returns.
            if outcome.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            let _ = std::fs::remove_file(&path);
            match outcome {
                Ok(served) => {
                    tracing::info!(
                        sandbox,
                        snapshot = id,
                        faults = served.faults,
                        hot_pages = served.hot,
                        "lazy restore complete"
                    )
                }
                Err(e) => tracing::error!(
                    sandbox,
                    snapshot = id,
                    error = %e,
                    "lazy restore failed: its VMM is stopped"
                ),
            }
        })
        .map_err(|e| Error::Internal(format!("starting a page server thread: {e}")))?;
    Ok(socket)
}

/// The one connection of the VMM's restore, within [`CONNECT_TIMEOUT`].
fn accept(listener: &UnixListener) -> Result<UnixStream> {
    let mut fd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = CONNECT_TIMEOUT.as_millis() as libc::c_int;
    // SAFETY: poll(2) on one valid pollfd.
    match unsafe { libc::poll(&mut fd, 1, ms) } {
        1 => {}
        0 => {
            return Err(Error::FailedPrecondition(format!(
                "no VMM connected to the page server within {CONNECT_TIMEOUT:?}"
            )))
        }
        _ => {
            return Err(Error::io(
                "waiting for the VMM",
                std::io::Error::last_os_error(),
            ))
        }
    }
    let (conn, _) = listener
        .accept()
        .map_err(|e| Error::io("accepting the VMM's connection", e))?;
    Ok(conn)
}

/// Fetches the pages of `hot` (runs inside `source`) from the registry
/// into the page source, a chunk at a time, on a thread of its own,
/// until done, `stop` is set or a fetch fails (then the faults fetch what
/// they need, and say what is wrong).
fn prefetch_hot(
    source: &Arc<PageSource>,
    hot: &[(u64, u64)],
    id: &str,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    if hot.is_empty() {
        return Ok(());
    }
    let chunks = chunks(hot, source.pages());
    let pages: u64 = chunks.iter().map(|(_, n)| n).sum();
    let (source, id) = (source.clone(), id.to_string());
    std::thread::Builder::new()
        .name(format!("hot-{id}"))
        .spawn(move || {
            let started = Instant::now();
            for (first, n) in chunks {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let pages: Vec<u64> = (first..first + n).collect();
                if let Err(e) = source.prefetch(&pages) {
                    tracing::warn!(snapshot = id, error = %e, "prefetching its hot pages stopped");
                    return;
                }
            }
            tracing::debug!(
                snapshot = id,
                pages,
                ms = started.elapsed().as_millis() as u64,
                "hot pages fetched"
            );
        })
        .map_err(|e| Error::Internal(format!("starting a prefetch thread: {e}")))?;
    Ok(())
}

/// `runs` clipped to `pages` and cut into chunks of at most
/// [`FILL_CHUNK`] pages, in order.
fn chunks(runs: &[(u64, u64)], pages: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(first, n) in runs {
        let end = first.saturating_add(n).min(pages);
        let mut at = first;
        while at < end {
            let k = FILL_CHUNK.min(end - at);
            out.push((at, k));
            at += k;
        }
    }
    out
}

/// What a page server did for its VM.
struct Served {
    /// Faults answered.
    faults: u64,
    /// Pages of the hot list copied in before the guest asked for them.
    hot: u64,
}

/// Serves faults until the pull has finished and every page is in,
/// copying the hot pages in whenever no fault waits.
fn run(
    conn: UnixStream,
    source: &Arc<PageSource>,
    mut pull: LazyPull,
    pace: Option<NonZeroU64>,
    rt: &tokio::runtime::Handle,
) -> Result<Served> {
    let server = PageServer::accept(conn, CONNECT_TIMEOUT)
        .map_err(|e| Error::FailedPrecondition(format!("the VMM's handshake: {e}")))?;
    let mut hot = chunks(&std::mem::take(&mut pull.hot), source.pages()).into_iter();
    let mut next_hot = hot.next();
    // The rest is downloaded once the VMM has read the staged state and
    // disks (which the pull publishes, or drops when it fails): a VMM
    // that never comes drops the pull, and its stagings, with it.
    let (done_tx, done) = mpsc::channel();
    rt.spawn(async move {
        let finished = pull.finish_paced(pace).await;
        // The server may have stopped (its VMM gone): nobody to tell.
        let _ = done_tx.send(finished.map(|p| p.bytes_downloaded));
    });
    let pages = server.layout().mem_size / PAGE;
    if pages != source.pages() {
        return Err(Error::FailedPrecondition(format!(
            "the VM has {pages} pages of memory, the snapshot {}",
            source.pages()
        )));
    }
    let started = Instant::now();
    let mut buf = vec![0u8; (FILL_CHUNK * PAGE) as usize];
    let mut served = Served { faults: 0, hot: 0 };
    // Whether the last look found no fault waiting.
    let mut idle = true;
    loop {
        // The next chunk of the hot list goes in once the prefetch has
        // fetched it, and only while no fault waits: a range read for it
        // here would hold the faults behind it. Looked at only when idle,
        // not once per fault.
        let hot_ready = next_hot.filter(|(first, n)| idle && source.is_cached(*first, *n));
        let wait = match (hot_ready, next_hot) {
            (Some(_), _) => Duration::ZERO,
            (None, Some(_)) if !idle => Duration::ZERO,
            (None, Some(_)) => HOT_POLL,
            (None, None) => POLL,
        };
        idle = true;
        match server.next_fault(Some(wait)) {
            Ok(Some(page)) if page >= pages => {
                return Err(Error::FailedPrecondition(format!(
                    "the VMM asked for page {page} of {pages}"
                )))
            }
            Ok(Some(page)) => {
                let first = page - page % FAULT_WINDOW;
                let n = FAULT_WINDOW.min(pages - first);
                put(&server, source, first, n, &mut buf)?;
                served.faults += 1;
                idle = false;
                continue;
            }
            Ok(None) => {
                if let Some((first, n)) = hot_ready {
                    served.hot += put(&server, source, first, n, &mut buf)?;
                    next_hot = hot.next();
                    continue;
                }
            }
            // The VMM exited: nothing more to serve (the pull goes on).
            Err(e) => return Err(Error::FailedPrecondition(format!("the VMM went away: {e}"))),
        }
        match done.try_recv() {
            Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => {
                return Err(Error::Internal("the pull stopped without an answer".into()))
            }
            Ok(Err(e)) => return Err(Error::Registry(e)),
            Ok(Ok(bytes)) => {
                tracing::debug!(
                    faults = served.faults,
                    hot = served.hot,
                    bytes,
                    after_ms = started.elapsed().as_millis() as u64,
                    "pull finished: copying in the rest"
                );
                let mut first = 0;
                while first < pages {
                    let n = FILL_CHUNK.min(pages - first);
                    put(&server, source, first, n, &mut buf)?;
                    first += n;
                }
                server
                    .complete()
                    .map_err(|e| Error::FailedPrecondition(format!("completing: {e}")))?;
                return Ok(served);
            }
        }
    }
}

const PAGE: u64 = 4096;

/// Reads pages `first..first + n` from `source` and puts them into the
/// VM (zeros as zero pages); pages already there are left as they are.
/// Returns the pages it put in.
fn put(
    server: &PageServer,
    source: &PageSource,
    first: u64,
    n: u64,
    buf: &mut [u8],
) -> Result<u64> {
    let data = &mut buf[..(n * PAGE) as usize];
    source.read(first, data)?;
    let copied = if data.iter().all(|b| *b == 0) {
        server.zero(first, n)
    } else {
        server.copy(first, data)
    };
    copied.map_err(|e| Error::FailedPrecondition(format!("copying guest pages {first}+{n}: {e}")))
}
