//! The pool of prepared twig-net program sets: each a directory under
//! `net_pool.dir` holding one set's maps and verified programs, pinned and
//! not attached ([`twig_net::Loader::prepare`]). A background thread keeps
//! `net_pool.size` of them ready; [`NetPool::take`] hands one to a shim by
//! renaming its directory to the pod's (the shim then attaches it with
//! [`twig_net::Loader::attach_prepared`]), so the verifier runs here, off
//! every pod's path. Whatever the pool still holds is unpinned when it
//! closes, and sets a dead daemon left are removed at start.
//!
//! The pool directory must be on the same bpffs as the shims' `bpffs_root`
//! (a rename cannot cross mounts), and names hold no `.` (bpffs refuses
//! dots). Each set holds ~0.75 MiB of locked kernel memory (the
//! preallocated `flows` map).
//!
//! Why per-pod sets, not one shared set: one set for every pod would key
//! each map by the pod (ifindexes repeat across network namespaces), share
//! a `flows` LRU whose evictions one pod could force on another, and make a
//! verifier bug or map corruption node-wide. The pool keeps one pod, one
//! set, one policy, and moves only the load off the pod's path.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use twig_net::Loader;

use crate::config::NetPoolConfig;
use crate::error::{Error, Result};

/// How long the filler waits after a failed load before it tries again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// Tells the pools of one process apart in their sets' names.
static INSTANCE: AtomicU64 = AtomicU64::new(0);

/// The prepared sets and the thread that refills them.
pub struct NetPool {
    shared: Arc<Shared>,
    filler: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    dir: PathBuf,
    size: usize,
    /// `<pid>-<instance>-`: the prefix of this pool's sets' names.
    prefix: String,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    ready: Vec<PathBuf>,
    next: u64,
    closed: bool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl NetPool {
    /// Starts the pool `config` asks for: `None` when its size is 0, or when
    /// this kernel cannot run twig-net or its directory cannot be made on a
    /// bpffs (logged; the daemon serves on, the shims then load their own
    /// sets, or refuse pods whose network they cannot filter).
    pub fn start(config: &NetPoolConfig) -> Result<Option<NetPool>> {
        if config.size == 0 {
            return Ok(None);
        }
        let loader = match Loader::new() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("no twig-net program sets are prepared: {e}");
                return Ok(None);
            }
        };
        if let Err(e) = prepare_dir(&config.dir) {
            tracing::warn!("no twig-net program sets are prepared: {e}");
            return Ok(None);
        }
        remove_orphans(&config.dir);
        let shared = Arc::new(Shared {
            dir: config.dir.clone(),
            size: config.size,
            prefix: format!(
                "{}-{}-",
                std::process::id(),
                INSTANCE.fetch_add(1, Ordering::Relaxed)
            ),
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        let filler = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("twig-net-pool".into())
                .spawn(move || fill(&shared, &loader))
                .map_err(|e| Error::io("starting the twig-net pool's thread", e))?
        };
        tracing::info!(dir = %config.dir.display(), size = config.size, "twig-net pool started");
        Ok(Some(NetPool {
            shared,
            filler: Mutex::new(Some(filler)),
        }))
    }

    /// How many sets are ready.
    pub fn ready(&self) -> usize {
        self.shared.state().ready.len()
    }

    /// Moves a ready set to `dir` (absolute, not existing, on the pool's
    /// bpffs); `false` when none is ready. The filler starts preparing the
    /// next one at once.
    pub fn take(&self, dir: &Path, sandbox_id: &str) -> Result<bool> {
        if !dir.is_absolute()
            || dir.file_name().is_none()
            || dir.starts_with(&self.shared.dir)
            || dir
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(Error::InvalidArgument(format!(
                "{} is no pod directory for a twig-net set (absolute, outside {})",
                dir.display(),
                self.shared.dir.display()
            )));
        }
        if dir.symlink_metadata().is_ok() {
            return Err(Error::FailedPrecondition(format!(
                "{} exists already",
                dir.display()
            )));
        }
        let set = {
            let mut state = self.shared.state();
            let set = state.ready.pop();
            self.shared.wake.notify_all();
            set
        };
        let Some(set) = set else {
            tracing::info!(sandbox_id, "twig-net pool empty");
            return Ok(false);
        };
        if let Err(e) = std::fs::rename(&set, dir) {
            remove_set(&set);
            return Err(match e.kind() {
                std::io::ErrorKind::AlreadyExists | std::io::ErrorKind::DirectoryNotEmpty => {
                    Error::FailedPrecondition(format!("{} exists already", dir.display()))
                }
                _ => Error::io(
                    format!("moving the set {} to {}", set.display(), dir.display()),
                    e,
                ),
            });
        }
        tracing::info!(sandbox_id, dir = %dir.display(), "twig-net set handed over");
        Ok(true)
    }

    /// Stops the filler (after the load it is in, if any) and removes every
    /// set still pooled, then the pool's directory if nothing else is in it.
    pub fn close(&self) {
        self.shared.state().closed = true;
        self.shared.wake.notify_all();
        let filler = self
            .filler
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(filler) = filler {
            if filler.join().is_err() {
                tracing::warn!("the twig-net pool's thread panicked");
            }
        }
        for set in std::mem::take(&mut self.shared.state().ready) {
            remove_set(&set);
        }
        if let Err(e) = std::fs::remove_dir(&self.shared.dir) {
            tracing::debug!(dir = %self.shared.dir.display(), "keeping the pool directory: {e}");
        }
    }
}

impl Drop for NetPool {
    fn drop(&mut self) {
        self.close();
    }
}

/// The filler: keeps `size` sets ready until the pool closes. It runs
/// under `SCHED_IDLE`: loading a set (the verifier, in the kernel on this
/// thread's behalf) yields the CPU to anything else that wants it, above
/// all to the pods starting at that moment, whose sets it replaces.
fn fill(shared: &Shared, loader: &Loader) {
    let idle = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler on the calling thread (pid 0) with a
    // valid sched_param that outlives the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) } != 0 {
        tracing::warn!(
            "the twig-net pool's thread keeps its priority: {}",
            std::io::Error::last_os_error()
        );
    }
    loop {
        let path = {
            let mut state = shared.state();
            while !state.closed && state.ready.len() >= shared.size {
                state = shared
                    .wake
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if state.closed {
                return;
            }
            state.next += 1;
            shared.dir.join(format!("{}{}", shared.prefix, state.next))
        };
        match loader.prepare(&path) {
            Ok(()) => {
                let mut state = shared.state();
                if state.closed {
                    drop(state);
                    remove_set(&path);
                    return;
                }
                state.ready.push(path);
                tracing::debug!(ready = state.ready.len(), "twig-net set prepared");
            }
            Err(e) => {
                tracing::warn!(set = %path.display(), "preparing a twig-net set: {e}");
                let state = shared.state();
                if state.closed {
                    return;
                }
                // Woken early only by close (or a take).
                drop(
                    shared
                        .wake
                        .wait_timeout(state, RETRY_AFTER)
                        .unwrap_or_else(PoisonError::into_inner),
                );
            }
        }
    }
}

/// Creates `dir` on a bpffs (mounting one on its parent if that is on
/// none).
fn prepare_dir(dir: &Path) -> Result<()> {
    let root = dir.parent().ok_or_else(|| {
        Error::InvalidArgument(format!("net_pool.dir {} has no parent", dir.display()))
    })?;
    twig_net::ensure_bpffs(root).map_err(|e| {
        Error::FailedPrecondition(format!("preparing the bpffs at {}: {e}", root.display()))
    })?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))
}

/// Removes a set's pins and its directory.
fn remove_set(set: &Path) {
    if let Ok(entries) = std::fs::read_dir(set) {
        for entry in entries.flatten() {
            if let Err(e) = std::fs::remove_file(entry.path()) {
                tracing::warn!(pin = %entry.path().display(), "removing a pooled set's pin: {e}");
            }
        }
    }
    if let Err(e) = std::fs::remove_dir(set) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(set = %set.display(), "removing a pooled set: {e}");
        }
    }
}

/// Removes the sets of pools whose daemon is gone (named `<pid>-…` after a
/// process that no longer runs).
fn remove_orphans(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if !alive {
            tracing::info!(set = %entry.path().display(), "removing a set a dead daemon left");
            remove_set(&entry.path());
        }
    }
}
