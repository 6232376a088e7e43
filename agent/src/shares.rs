//! File shares: host directories (hostPath, filesystem PVCs) the host
//! serves over 9P2000.L. A third listener, on vsock port
//! [`twig_agent::proto::FILE_SHARE_VSOCK_PORT`] (or a Unix socket in host
//! tests), takes connections whose fixed-size [`file_share`] request names
//! a share id; the stream waits here until a `PrepareVolume` names that id
//! ([`take`]), and is handed to the guest kernel as the transport of a 9p
//! mount (`trans=fd`, [`mount`]): the kernel holds the socket from then on.
//!
//! What arrives is bounded: a request is read within [`REQUEST_TIMEOUT`]
//! (malformed: closed), at most [`MAX_PENDING`] streams wait (the oldest
//! goes first), and a stream nobody takes within [`PENDING_FOR`] is closed.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::mount::{mount as sys_mount, MsFlags};
use twig_agent::proto::file_share::{decode, REQUEST_LEN};

use crate::error::{AgentError, Result};
use crate::forward::{set_timeouts, Listener};

/// How long a request may take to arrive.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams waiting for their `PrepareVolume` at once.
pub const MAX_PENDING: usize = 64;
/// How long a stream waits for its `PrepareVolume`.
pub const PENDING_FOR: Duration = Duration::from_secs(60);
/// How long a `PrepareVolume` waits for its stream.
pub const ARRIVAL: Duration = Duration::from_secs(10);
/// The 9p message size: the host server's largest (64 KiB of data and its
/// header).
const MSIZE: u32 = 64 * 1024 + 24;

struct Pending {
    streams: Mutex<BTreeMap<String, (OwnedFd, Instant)>>,
    arrived: Condvar,
}

static PENDING: Pending = Pending {
    streams: Mutex::new(BTreeMap::new()),
    arrived: Condvar::new(),
};

/// Binds `listen` and takes share connections on a thread of its own.
pub fn start(listen: &str) -> std::io::Result<()> {
    Listener::serve_on("shares", listen, serve)
}

fn serve(listener: Listener) {
    loop {
        let conn = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("file-share accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let mut stream = File::from(conn);
        let mut request = [0u8; REQUEST_LEN];
        let id = set_timeouts(&stream, Some(REQUEST_TIMEOUT))
            .and_then(|()| stream.read_exact(&mut request))
            .and_then(|()| set_timeouts(&stream, None))
            .ok()
            .and_then(|()| decode(&request));
        let Some(id) = id else {
            tracing::warn!("file-share: a malformed or late request, closed");
            continue;
        };
        let mut streams = lock();
        let now = Instant::now();
        streams.retain(|_, (_, at)| now.duration_since(*at) < PENDING_FOR);
        while streams.len() >= MAX_PENDING {
            let oldest = streams
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => streams.remove(&k),
                None => break,
            };
        }
        streams.insert(id, (OwnedFd::from(stream), now));
        PENDING.arrived.notify_all();
    }
}

fn lock() -> std::sync::MutexGuard<'static, BTreeMap<String, (OwnedFd, Instant)>> {
    PENDING.streams.lock().unwrap_or_else(|p| p.into_inner())
}

/// The stream of share `id`, waiting up to `wait` for it to arrive.
pub fn take(id: &str, wait: Duration) -> Result<OwnedFd> {
    let deadline = Instant::now() + wait;
    let mut streams = lock();
    loop {
        if let Some((fd, _)) = streams.remove(id) {
            return Ok(fd);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AgentError::FailedPrecondition(format!(
                "file share {id}: its connection did not arrive within {wait:?}"
            )));
        }
        streams = PENDING
            .arrived
            .wait_timeout(streams, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Mounts the 9P2000.L filesystem served on `stream` at `dir`
/// (`nosuid,nodev`, read-only if asked). The kernel keeps its own reference
/// to the stream; this one is closed on return.
pub fn mount(stream: OwnedFd, dir: &Path, read_only: bool) -> Result<()> {
    let fd = stream.as_raw_fd();
    let data = format!("trans=fd,rfdno={fd},wfdno={fd},version=9p2000.L,msize={MSIZE}");
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    sys_mount(
        Some("twig-share"),
        dir,
        Some("9p"),
        flags,
        Some(data.as_str()),
    )
    .map_err(|e| AgentError::sys(format!("mounting the file share on {}", dir.display()), e))
}
