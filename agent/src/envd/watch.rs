//! Directory watchers on inotify: `CreateWatcher`/`GetWatcherEvents`/
//! `RemoveWatcher` (events buffered until fetched) and the `WatchDir`
//! stream. The watches are added inside the container as the caller's user
//! (so a directory the user cannot read cannot be watched); a thread per
//! watcher blocks reading its inotify descriptor. Removing a watcher
//! removes its watches, whose `IN_IGNORED` events wake and end that
//! thread: nothing polls.
//!
//! Events read as fsnotify (which envd uses) words them: a name relative
//! to the watched directory and `EVENT_TYPE_CREATE` (also a file moved
//! in), `_WRITE`, `_REMOVE`, `_RENAME` (moved away) or `_CHMOD`.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use serde::Deserialize;
use serde_json::{json, Value};

use super::connect::{decode, Code, RpcError};
use super::filesystem::{caller_context, entry_info, resolve};
use super::sandbox::{in_container, Names, Target, User};
use super::{Caller, Shared, StreamOut};
use crate::reaper::lock;

/// The most watchers a sandbox keeps.
const MAX_WATCHERS: usize = 256;
/// The most directories one watcher watches.
const MAX_DIRS: usize = 8192;
/// The most events a watcher buffers until they are fetched (later ones
/// are dropped, with a warning).
const MAX_BUFFERED: usize = 65_536;
/// How many events wait for a slow `WatchDir` stream.
const STREAM_DEPTH: usize = 1024;

fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

/// The event types of one inotify event; `root`: it is of the watched
/// directory itself (its `*_SELF` events count only there).
fn event_types(m: AddWatchFlags, root: bool) -> Vec<&'static str> {
    let mut v = Vec::new();
    if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
        v.push("EVENT_TYPE_CREATE");
    }
    if m.contains(AddWatchFlags::IN_MODIFY) {
        v.push("EVENT_TYPE_WRITE");
    }
    if m.contains(AddWatchFlags::IN_DELETE) || (root && m.contains(AddWatchFlags::IN_DELETE_SELF)) {
        v.push("EVENT_TYPE_REMOVE");
    }
    if m.contains(AddWatchFlags::IN_MOVED_FROM) || (root && m.contains(AddWatchFlags::IN_MOVE_SELF))
    {
        v.push("EVENT_TYPE_RENAME");
    }
    if m.contains(AddWatchFlags::IN_ATTRIB) {
        v.push("EVENT_TYPE_CHMOD");
    }
    v
}

/// Where a watcher's events go.
enum Sink {
    /// Kept until GetWatcherEvents.
    Buffer(Mutex<VecDeque<Value>>),
    /// A WatchDir stream (dropped when the watcher ends, which ends it).
    Stream(Mutex<Option<SyncSender<Value>>>),
}

/// One watcher.
pub struct Watcher {
    inotify: Inotify,
    target: Target,
    user: User,
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
    dirs: Mutex<HashMap<WatchDescriptor, PathBuf>>,
    stopped: AtomicBool,
    sink: Sink,
}

/// The watchers of a sandbox, by id.
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Arc<Watcher>>>,
    next: AtomicU64,
}

/// Adds watches on `dir` (relative `rel`) and, if `recursive`, on every
/// directory under it; call inside the container.
fn add_tree(
    inotify: &Inotify,
    root: &Path,
    rel: PathBuf,
    recursive: bool,
    dirs: &mut HashMap<WatchDescriptor, PathBuf>,
) -> Result<(), RpcError> {
    let mut pending = vec![rel];
    while let Some(rel) = pending.pop() {
        if dirs.len() >= MAX_DIRS {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("over {MAX_DIRS} directories to watch"),
            ));
        }
        let path = root.join(&rel);
        let wd = inotify
            .add_watch(&path, mask())
            .map_err(|e| RpcError::io(path.display(), &std::io::Error::from(e)))?;
        dirs.insert(wd, rel.clone());
        if recursive {
            let Ok(rd) = std::fs::read_dir(&path) else {
                continue;
            };
            for e in rd.filter_map(|e| e.ok()) {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    pending.push(rel.join(e.file_name()));
                }
            }
        }
    }
    Ok(())
}

impl Watcher {
    fn create(
        target: Target,
        user: User,
        path: &str,
        recursive: bool,
        include_entry: bool,
        sink: Sink,
    ) -> Result<Arc<Watcher>, RpcError> {
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC)
            .map_err(|e| RpcError::internal(format!("inotify_init: {e}")))?;
        let (root, dirs) = in_container(&target, Some(&user), || {
            let root = resolve(path, &user.home)?;
            let meta = std::fs::metadata(&root).map_err(|e| RpcError::io(root.display(), &e))?;
            if !meta.is_dir() {
                return Err(RpcError::invalid(format!(
                    "{} is not a directory",
                    root.display()
                )));
            }
            let mut dirs = HashMap::new();
            add_tree(&inotify, &root, PathBuf::new(), recursive, &mut dirs)?;
            Ok((root, dirs))
        })?;
        let w = Arc::new(Watcher {
            inotify,
            target,
            user,
            root,
            recursive,
            include_entry,
            dirs: Mutex::new(dirs),
            stopped: AtomicBool::new(false),
            sink,
        });
        let reader = w.clone();
        std::thread::Builder::new()
            .name("envd-watch".into())
            .spawn(move || reader.run())
            .map_err(|e| RpcError::internal(format!("starting a watcher thread: {e}")))?;
        Ok(w)
    }

    /// Removes every watch: the thread sees their `IN_IGNORED` and ends.
    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let wds: Vec<WatchDescriptor> = lock(&self.dirs).keys().copied().collect();
        for wd in wds {
            let _ = self.inotify.rm_watch(wd);
        }
    }

    fn run(&self) {
        loop {
            let events = match self.inotify.read_events() {
                Ok(e) => e,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    tracing::warn!("reading a watcher's inotify: {e}");
                    break;
                }
            };
            let mut found: Vec<(PathBuf, &'static str)> = Vec::new();
            let mut new_dirs: Vec<PathBuf> = Vec::new();
            let mut ended = false;
            {
                let mut dirs = lock(&self.dirs);
                for ev in events {
                    if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                        dirs.remove(&ev.wd);
                        ended |= dirs.is_empty();
                        continue;
                    }
                    if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                        tracing::warn!(root = %self.root.display(), "a watcher lost events (inotify queue overflow)");
                        continue;
                    }
                    let Some(dir) = dirs.get(&ev.wd) else {
                        continue;
                    };
                    let rel = match &ev.name {
                        Some(n) => dir.join(n),
                        None => dir.clone(),
                    };
                    let is_root = ev.name.is_none() && dir.as_os_str().is_empty();
                    let is_self = ev.name.is_none() && !is_root;
                    if is_self {
                        continue;
                    }
                    for t in event_types(ev.mask, is_root) {
                        found.push((rel.clone(), t));
                    }
                    let made_dir = ev.mask.contains(AddWatchFlags::IN_ISDIR)
                        && ev
                            .mask
                            .intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO);
                    if self.recursive && made_dir {
                        new_dirs.push(rel);
                    }
                }
            }
            if self.stopped.load(Ordering::SeqCst) {
                if ended {
                    break;
                }
                continue;
            }
            if !new_dirs.is_empty() {
                self.watch_new(new_dirs);
            }
            if !found.is_empty() && !self.deliver(found) {
                self.stop();
            }
            if ended {
                break;
            }
        }
        if let Sink::Stream(tx) = &self.sink {
            lock(tx).take();
        }
    }

    fn watch_new(&self, new_dirs: Vec<PathBuf>) {
        let r = in_container(&self.target, Some(&self.user), || {
            let mut dirs = lock(&self.dirs);
            for rel in new_dirs {
                match add_tree(&self.inotify, &self.root, rel, true, &mut dirs) {
                    Err(e) if e.code == Code::ResourceExhausted => return Err(e),
                    // Gone again already, or unreadable: nothing to watch.
                    _ => {}
                }
            }
            Ok(())
        });
        if let Err(e) = r {
            tracing::warn!(root = %self.root.display(), "watching new directories: {e}");
        }
    }

    /// Hands the events on; false when the stream is gone.
    fn deliver(&self, found: Vec<(PathBuf, &'static str)>) -> bool {
        let entries: Vec<Option<Value>> = if self.include_entry {
            let paths: Vec<PathBuf> = found.iter().map(|(rel, _)| self.root.join(rel)).collect();
            in_container(&self.target, Some(&self.user), || {
                let names = Names::load();
                Ok(paths.iter().map(|p| entry_info(p, &names).ok()).collect())
            })
            .unwrap_or_else(|_| vec![None; found.len()])
        } else {
            vec![None; found.len()]
        };
        for ((rel, kind), entry) in found.into_iter().zip(entries) {
            let name: OsString = rel.into_os_string();
            let mut ev = json!({"name": name.to_string_lossy(), "type": kind});
            if let Some(e) = entry.filter(|_| kind != "EVENT_TYPE_REMOVE") {
                ev["entry"] = e;
            }
            match &self.sink {
                Sink::Buffer(buf) => {
                    let mut buf = lock(buf);
                    if buf.len() >= MAX_BUFFERED {
                        tracing::warn!(root = %self.root.display(), "a watcher's {MAX_BUFFERED} events are not fetched: dropping");
                        return true;
                    }
                    buf.push_back(ev);
                }
                Sink::Stream(tx) => {
                    let tx = lock(tx).clone();
                    if tx.is_none_or(|tx| tx.send(ev).is_err()) {
                        return false;
                    }
                }
            }
        }
        true
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchRequest {
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default)]
    include_entry: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct IdRequest {
    watcher_id: String,
}

fn new_watcher(
    shared: &Shared,
    caller: &Caller,
    req: &WatchRequest,
    sink: Sink,
) -> Result<Arc<Watcher>, RpcError> {
    if lock(&shared.watchers.map).len() >= MAX_WATCHERS {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("{MAX_WATCHERS} watchers exist: remove some"),
        ));
    }
    let (target, user) = caller_context(shared, caller.user.as_deref())?;
    Watcher::create(
        target,
        user,
        &req.path,
        req.recursive,
        req.include_entry,
        sink,
    )
}

/// `CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`.
pub fn unary(
    shared: &Shared,
    caller: &Caller,
    method: &str,
    body: &[u8],
) -> Result<Value, RpcError> {
    let watchers = &shared.watchers;
    match method {
        "CreateWatcher" => {
            let req: WatchRequest = decode(body)?;
            let w = new_watcher(shared, caller, &req, Sink::Buffer(Mutex::default()))?;
            let id = format!("w{}", watchers.next.fetch_add(1, Ordering::Relaxed) + 1);
            lock(&watchers.map).insert(id.clone(), w);
            Ok(json!({ "watcherId": id }))
        }
        "GetWatcherEvents" => {
            let req: IdRequest = decode(body)?;
            let w = lock(&watchers.map)
                .get(&req.watcher_id)
                .cloned()
                .ok_or_else(|| RpcError::not_found(format!("no watcher {:?}", req.watcher_id)))?;
            let events: Vec<Value> = match &w.sink {
                Sink::Buffer(b) => lock(b).drain(..).collect(),
                Sink::Stream(_) => Vec::new(),
            };
            Ok(json!({ "events": events }))
        }
        _ => {
            let req: IdRequest = decode(body)?;
            let w = lock(&watchers.map)
                .remove(&req.watcher_id)
                .ok_or_else(|| RpcError::not_found(format!("no watcher {:?}", req.watcher_id)))?;
            w.stop();
            Ok(json!({}))
        }
    }
}

/// Stops a watcher when its stream ends, however it ends.
struct StopOnDrop(Arc<Watcher>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// `WatchDir`: `start`, then the events (and keepalives) until the client
/// goes or the directory does. (The response's `event` is a oneof: its
/// members are the message's JSON fields.)
pub fn stream(
    shared: &Shared,
    caller: &Caller,
    msg: &[u8],
    out: &mut StreamOut<'_>,
) -> Result<(), RpcError> {
    let req: WatchRequest = decode(msg)?;
    let (tx, rx) = sync_channel(STREAM_DEPTH);
    let w = new_watcher(shared, caller, &req, Sink::Stream(Mutex::new(Some(tx))))?;
    let _stop = StopOnDrop(w);
    out.send(&json!({"start": {}}))?;
    loop {
        let ev = match caller.keepalive {
            Some(every) => match rx.recv_timeout(every) {
                Ok(ev) => ev,
                Err(RecvTimeoutError::Timeout) => {
                    out.send(&json!({"keepalive": {}}))?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            },
            None => match rx.recv() {
                Ok(ev) => ev,
                Err(_) => return Ok(()),
            },
        };
        out.send(&json!({ "filesystem": ev }))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inotify_masks_map_to_fsnotify_types() {
        assert_eq!(
            event_types(AddWatchFlags::IN_CREATE, false),
            ["EVENT_TYPE_CREATE"]
        );
        assert_eq!(
            event_types(AddWatchFlags::IN_MOVED_TO, false),
            ["EVENT_TYPE_CREATE"]
        );
        assert_eq!(
            event_types(AddWatchFlags::IN_MODIFY, false),
            ["EVENT_TYPE_WRITE"]
        );
        assert_eq!(
            event_types(AddWatchFlags::IN_MOVED_FROM, false),
            ["EVENT_TYPE_RENAME"]
        );
        assert_eq!(
            event_types(AddWatchFlags::IN_ATTRIB, false),
            ["EVENT_TYPE_CHMOD"]
        );
        assert!(event_types(AddWatchFlags::IN_DELETE_SELF, false).is_empty());
        assert_eq!(
            event_types(AddWatchFlags::IN_DELETE_SELF, true),
            ["EVENT_TYPE_REMOVE"]
        );
    }
}
