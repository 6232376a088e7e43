//! Live configuration volumes: kubelet rewrites a ConfigMap, Secret,
//! projected (the ServiceAccount token) or downward API volume on the host
//! (its atomic writer: a new `..<timestamp>` directory, the `..data`
//! symlink renamed over, the old directory removed); the guest's copy
//! follows. One thread per shim sleeps on one inotify descriptor for every
//! watched volume's top directory (no polling: an idle pod costs nothing),
//! and once a volume's events have been quiet for [`SETTLE`] hands it to
//! its sync function, so one kubelet update is one `SyncVolume`.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

use crate::error::{Error, Result};

/// How long a volume's events must be quiet before it is synced: kubelet's
/// writer makes several changes per update.
pub const SETTLE: Duration = Duration::from_millis(100);

/// What syncs a watched volume into the guest.
pub type SyncFn = Arc<dyn Fn() -> Result<()> + Send + Sync>;

struct Watched {
    /// The container it belongs to (unwatched with it).
    owner: String,
    /// The host directory, for logs.
    dir: PathBuf,
    sync: SyncFn,
}

#[derive(Default)]
struct State {
    inotify: Option<Arc<Inotify>>,
    /// By inotify's descriptor: one per host directory, however many
    /// containers mount it (a ConfigMap two containers mount, a restarted
    /// container beside its exited attempt), each with its own sync.
    watched: HashMap<WatchDescriptor, Vec<Watched>>,
}

/// The shim's watcher of live volumes (cheap to clone).
#[derive(Clone, Default)]
pub struct Watcher {
    state: Arc<Mutex<State>>,
}

impl Watcher {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watches host directory `dir` for container `owner`: `sync` runs
    /// after each settled change. The first watch starts the thread.
    pub fn watch(&self, owner: &str, dir: PathBuf, sync: SyncFn) -> Result<()> {
        let mut state = self.lock();
        let inotify = match &state.inotify {
            Some(i) => i.clone(),
            None => {
                let i = Arc::new(
                    Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).map_err(|e| {
                        Error::Internal(format!("inotify for the pod's volumes: {e}"))
                    })?,
                );
                let (thread_inotify, watcher) = (i.clone(), self.clone());
                std::thread::Builder::new()
                    .name("twig-volumes".into())
                    .spawn(move || watcher.run(&thread_inotify))
                    .map_err(|e| Error::Internal(format!("starting the volume watcher: {e}")))?;
                state.inotify = Some(i.clone());
                i
            }
        };
        let flags = AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_DELETE
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_MOVED_FROM
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_ATTRIB
            | AddWatchFlags::IN_ONLYDIR;
        let wd = inotify.add_watch(&dir, flags).map_err(|e| {
            Error::FailedPrecondition(format!(
                "watching volume {} on the host: {e}",
                dir.display()
            ))
        })?;
        state.watched.entry(wd).or_default().push(Watched {
            owner: owner.to_string(),
            dir,
            sync,
        });
        Ok(())
    }

    /// Stops watching container `owner`'s volumes.
    pub fn unwatch(&self, owner: &str) {
        let mut state = self.lock();
        let mut gone = Vec::new();
        for (wd, list) in state.watched.iter_mut() {
            list.retain(|w| w.owner != owner);
            if list.is_empty() {
                gone.push(*wd);
            }
        }
        for wd in gone {
            state.watched.remove(&wd);
            if let Some(i) = &state.inotify {
                // The directory may be gone already (IN_IGNORED).
                let _ = i.rm_watch(wd);
            }
        }
    }

    /// Every watched volume's sync, for a rollback that took the guest's
    /// copies back in time.
    pub fn syncs(&self) -> Vec<(PathBuf, SyncFn)> {
        self.lock()
            .watched
            .values()
            .flatten()
            .map(|w| (w.dir.clone(), w.sync.clone()))
            .collect()
    }

    /// The thread: wait for events (no timeout while nothing is pending),
    /// collect the volumes they touch, and sync each once they settle.
    fn run(&self, inotify: &Inotify) {
        let mut pending: Vec<WatchDescriptor> = Vec::new();
        loop {
            let timeout = if pending.is_empty() {
                PollTimeout::NONE
            } else {
                PollTimeout::try_from(SETTLE).unwrap_or(PollTimeout::MAX)
            };
            let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                Ok(0) => {
                    for wd in pending.drain(..) {
                        self.sync_one(wd);
                    }
                }
                Ok(_) => match inotify.read_events() {
                    Ok(events) => {
                        for e in events {
                            if e.mask.contains(AddWatchFlags::IN_IGNORED) {
                                self.lock().watched.remove(&e.wd);
                            } else if !pending.contains(&e.wd) {
                                pending.push(e.wd);
                            }
                        }
                    }
                    Err(nix::errno::Errno::EAGAIN) => {}
                    Err(e) => {
                        tracing::error!("reading volume events: {e}; live volumes stop updating");
                        return;
                    }
                },
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    tracing::error!("waiting for volume events: {e}; live volumes stop updating");
                    return;
                }
            }
        }
    }

    fn sync_one(&self, wd: WatchDescriptor) {
        let syncs: Vec<(PathBuf, SyncFn)> = self
            .lock()
            .watched
            .get(&wd)
            .into_iter()
            .flatten()
            .map(|w| (w.dir.clone(), w.sync.clone()))
            .collect();
        for (dir, sync) in syncs {
            match sync() {
                Ok(()) => tracing::debug!(dir = %dir.display(), "volume updated in the guest"),
                Err(e) => tracing::warn!(dir = %dir.display(), "updating the guest's copy: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use super::*;

    fn counting() -> (Arc<AtomicUsize>, SyncFn) {
        let n = Arc::new(AtomicUsize::new(0));
        let c = n.clone();
        (
            n,
            Arc::new(move || {
                c.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }),
        )
    }

    fn wait_for(n: &AtomicUsize, at_least: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while n.load(Ordering::SeqCst) < at_least {
            assert!(Instant::now() < deadline, "no sync within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_kubelet_style_update_syncs_once_settled_and_unwatched_never() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cfg");
        std::fs::create_dir(&dir).unwrap();
        let w = Watcher::default();
        let (n, sync) = counting();
        w.watch("app", dir.clone(), sync).unwrap();
        // kubelet's atomic writer: new data dir, ..data renamed over.
        std::fs::create_dir(dir.join("..2026_1")).unwrap();
        std::fs::write(dir.join("..2026_1/key"), "v2").unwrap();
        std::os::unix::fs::symlink("..2026_1", dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        wait_for(&n, 1);
        // The burst settled into one sync.
        std::thread::sleep(SETTLE * 3);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        assert_eq!(w.syncs().len(), 1);

        w.unwatch("app");
        assert!(w.syncs().is_empty());
        std::fs::write(dir.join("late"), "x").unwrap();
        std::thread::sleep(SETTLE * 3);
        assert_eq!(
            n.load(Ordering::SeqCst),
            1,
            "an unwatched volume is not synced"
        );
    }

    #[test]
    fn two_containers_on_one_directory_each_get_their_sync_until_unwatched() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cfg");
        std::fs::create_dir(&dir).unwrap();
        let w = Watcher::default();
        let (a, sync_a) = counting();
        let (b, sync_b) = counting();
        w.watch("app", dir.clone(), sync_a).unwrap();
        w.watch("sidecar", dir.clone(), sync_b).unwrap();
        std::fs::write(dir.join("k1"), "v").unwrap();
        wait_for(&a, 1);
        wait_for(&b, 1);
        // One container goes: the other's volume still follows.
        w.unwatch("app");
        assert_eq!(w.syncs().len(), 1);
        std::fs::write(dir.join("k2"), "v").unwrap();
        wait_for(&b, 2);
        std::thread::sleep(SETTLE * 3);
        assert_eq!(a.load(Ordering::SeqCst), 1, "app was unwatched");
    }
}
