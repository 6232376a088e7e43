//! The server side: one VM behind a mutex, a thread per connection.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind as IoKind, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::types::{
    ApiError, Hello, Reply, Request, Response, RestoreSlot, MAX_REQUEST, PROTOCOL_VERSION,
};
use crate::devices::SerialOut;
use crate::error::{Error, ErrorKind, Result};
use crate::snapshot::{self, Kind};
use crate::vm::{DeviceConfig, DiskConfig, LazySource, RunState, Shape, SlotImage, Vm};

/// Makes serial writers for the VMs this server creates.
pub type SerialFactory = Box<dyn Fn() -> Result<SerialOut> + Send>;

/// How the server treats its connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once; one more is answered with a `busy`
    /// error and closed.
    pub max_connections: usize,
    /// A connection that sends no complete request for this long is
    /// closed; so is one that does not take its response for this long.
    pub idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 16,
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// The VM and what makes it.
struct Machine {
    vm: Option<Vm>,
    /// The VM being created ahead of time (`--prepare-mem-mib`), until
    /// the first request waits for it.
    preparing: Option<JoinHandle<Vm>>,
    /// The VM created ahead of time.
    prepared: Option<Vm>,
    serial: SerialFactory,
    devices: DeviceConfig,
    shut_down: bool,
}

struct Shared {
    machine: Mutex<Machine>,
    limits: Limits,
    connections: AtomicUsize,
    stop: AtomicBool,
}

/// One VM and the API server around it. Requests from every connection are
/// served one at a time on the VM (they serialize on a mutex); reading and
/// writing happen outside it, so a slow or idle client blocks nobody.
pub struct Server {
    shared: Arc<Shared>,
}

impl Server {
    /// A server whose VM gets `devices`; with `prepare`, a VM of that shape
    /// is created from now on, on a thread of its own, so that a later boot
    /// or restore of that shape skips VM creation. Connections are accepted
    /// meanwhile, but the first request is answered once the VM exists: an
    /// answer still means a prepared VM. If creating it fails, the process
    /// exits with the error (status 1), as for any other start-up failure.
    pub fn new(
        serial: SerialFactory,
        prepare: Option<Shape>,
        devices: DeviceConfig,
        limits: Limits,
    ) -> Result<Server> {
        if limits.max_connections == 0 {
            return Err(Error::Config(
                "at least one API connection is needed".into(),
            ));
        }
        let preparing = match prepare {
            Some(shape) => Some(prepare_vm(shape, serial()?, devices.clone())?),
            None => None,
        };
        Ok(Server {
            shared: Arc::new(Shared {
                machine: Mutex::new(Machine {
                    vm: None,
                    preparing,
                    prepared: None,
                    serial,
                    devices,
                    shut_down: false,
                }),
                limits,
                connections: AtomicUsize::new(0),
                stop: AtomicBool::new(false),
            }),
        })
    }

    /// Serves clients on `listener` (bound to a path) until a shutdown
    /// request has been answered.
    pub fn serve(&self, listener: &UnixListener) -> Result<()> {
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the API socket's address", e))?;
        let wake: Option<PathBuf> = addr.as_pathname().map(Path::to_path_buf);
        for conn in listener.incoming() {
            if self.shared.stop.load(Ordering::SeqCst) {
                return Ok(());
            }
            let conn = match conn {
                Ok(c) => c,
                // Out of descriptors or memory: refuse this one, keep serving.
                Err(e) => {
                    tracing::warn!("accepting an API connection: {e}");
                    continue;
                }
            };
            let limits = self.shared.limits;
            let open = self.shared.connections.fetch_add(1, Ordering::SeqCst);
            let slot = ConnSlot(self.shared.clone());
            if open >= limits.max_connections {
                drop(slot);
                refuse(conn, limits.max_connections);
                continue;
            }
            let shared = self.shared.clone();
            let wake = wake.clone();
            let spawned = std::thread::Builder::new()
                .name("twig-api".into())
                .spawn(move || {
                    let _slot = slot;
                    match serve_conn(&shared, conn) {
                        Ok(true) => {
                            shared.stop.store(true, Ordering::SeqCst);
                            // Wake the accept loop so that it sees the stop.
                            if let Some(p) = wake {
                                let _ = UnixStream::connect(p);
                            }
                        }
                        Ok(false) => {}
                        Err(e) => tracing::debug!("API connection: {e}"),
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("cannot start an API connection thread: {e}");
            }
        }
        Ok(())
    }
}

/// Starts creating a VM of `shape` on a thread of its own (confined, like
/// the API threads, by the filter it inherits); a failure ends the process.
fn prepare_vm(shape: Shape, serial: SerialOut, devices: DeviceConfig) -> Result<JoinHandle<Vm>> {
    shape.validate()?;
    std::thread::Builder::new()
        .name("twig-prepare".into())
        .spawn(move || match Vm::create_with(shape, serial, &devices) {
            Ok(vm) => vm,
            Err(e) => {
                tracing::error!("creating the VM ahead of time: {e}");
                eprintln!("twig-vmm: {e}");
                std::process::exit(1)
            }
        })
        .map_err(|e| Error::io("starting the thread that prepares the VM", e))
}

/// Counts a connection until dropped.
struct ConnSlot(Arc<Shared>);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Answers a connection over the limit with a `busy` error and closes it.
fn refuse(mut conn: UnixStream, max: usize) {
    let resp = Response::Error(ApiError::new(
        ErrorKind::Busy,
        format!("this twig-vmm already serves {max} API connections; close one and retry"),
    ));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = writeln!(conn, "{}", resp.to_line());
}

/// Serves one connection; true once a shutdown was answered.
fn serve_conn(shared: &Shared, conn: UnixStream) -> Result<bool> {
    let idle = Some(shared.limits.idle_timeout);
    conn.set_read_timeout(idle)
        .and_then(|_| conn.set_write_timeout(idle))
        .map_err(|e| Error::io("setting API connection timeouts", e))?;
    let mut out = conn
        .try_clone()
        .map_err(|e| Error::io("cloning the API connection", e))?;
    let mut reader = BufReader::new(FdReader {
        conn,
        fds: VecDeque::new(),
    });
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = match (&mut reader)
            .take(MAX_REQUEST as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {
                tracing::debug!("closing an API connection idle for {idle:?}");
                return Ok(false);
            }
            Err(e) => return Err(Error::io("reading an API request", e)),
        };
        if n == 0 {
            return Ok(false);
        }
        let too_long = n > MAX_REQUEST;
        let (resp, exit) = if too_long {
            (
                Response::Error(ApiError::new(
                    ErrorKind::InvalidRequest,
                    format!("request longer than {MAX_REQUEST} bytes"),
                )),
                false,
            )
        } else {
            handle_line(shared, &line, &mut reader.get_mut().fds)
        };
        writeln!(out, "{}", resp.to_line()).map_err(|e| Error::io("writing an API response", e))?;
        if exit || too_long {
            return Ok(exit);
        }
    }
}

/// File descriptors a connection may have sent ahead of the requests that
/// use them; more are closed at once.
const MAX_PENDING_FDS: usize = 8;

/// The reading half of an API connection: reads like `read(2)`, and keeps
/// the file descriptors that come with the bytes (`SCM_RIGHTS`), in order,
/// for the requests that announce one (`attach_disk` with `fd`, `restore`
/// with `slots`).
struct FdReader {
    conn: UnixStream,
    fds: VecDeque<OwnedFd>,
}

impl Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut iov = [IoSliceMut::new(buf)];
        // Room for as many descriptors as one message can carry
        // (SCM_MAX_FD), so none is ever cut off and leaked.
        let mut space = nix::cmsg_space!([RawFd; 253]);
        let msg = recvmsg::<()>(
            self.conn.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        let n = msg.bytes;
        for cmsg in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                for fd in fds {
                    // SAFETY: the kernel just installed `fd` in this
                    // process for this message; nothing else owns it.
                    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                    if self.fds.len() < MAX_PENDING_FDS {
                        self.fds.push_back(fd);
                    }
                }
            }
        }
        Ok(n)
    }
}

/// Parses and handles one request line; `fds` are the descriptors the
/// connection sent that no request took yet.
fn handle_line(shared: &Shared, line: &[u8], fds: &mut VecDeque<OwnedFd>) -> (Response, bool) {
    let req = match std::str::from_utf8(line)
        .map_err(|e| e.to_string())
        .and_then(|s| serde_json::from_str::<Request>(s.trim()).map_err(|e| e.to_string()))
    {
        Ok(r) => r,
        Err(e) => {
            let err = ApiError::new(ErrorKind::InvalidRequest, format!("bad request: {e}"));
            return (Response::Error(err), false);
        }
    };
    let op = req.op();
    let mut machine = lock(&shared.machine);
    if machine.shut_down {
        let err = ApiError::new(ErrorKind::InvalidRequest, "this twig-vmm is shutting down");
        return (Response::Error(err), false);
    }
    match machine.handle(req, fds) {
        Ok(reply) => {
            let exit = matches!(reply, Reply::ShutDown {});
            machine.shut_down |= exit;
            (Response::Ok(reply), exit)
        }
        Err(e) => {
            tracing::warn!(op, kind = ?e.kind(), "API request failed: {e}");
            (Response::Error(ApiError::from(&e)), false)
        }
    }
}

fn lock(m: &Mutex<Machine>) -> MutexGuard<'_, Machine> {
    // A panic while holding the lock leaves the VM as it was at the panic;
    // the next request finds out through the VM's own state checks.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Fails with [`Error::SnapshotNotFound`] unless `dir` exists.
fn existing_snapshot(dir: &Path) -> Result<PathBuf> {
    let dir = std::path::absolute(dir)
        .map_err(|e| Error::io(format!("resolving {}", dir.display()), e))?;
    match std::fs::symlink_metadata(&dir) {
        Ok(_) => Ok(dir),
        Err(e) if e.kind() == IoKind::NotFound => Err(Error::SnapshotNotFound(dir)),
        Err(e) => Err(Error::io(format!("looking at {}", dir.display()), e)),
    }
}

impl Machine {
    fn fresh_vm(&mut self, shape: Shape) -> Result<&mut Vm> {
        if self.vm.is_some() {
            return Err(Error::Config(
                "this twig-vmm already has a VM; start another process for another VM".into(),
            ));
        }
        let vm = match self.prepared.take() {
            Some(vm) if vm.shape() == shape => vm,
            other => {
                // A prepared VM of another shape holds the devices (tap,
                // vsock socket): release them first.
                drop(other);
                Vm::create_with(shape, (self.serial)()?, &self.devices)?
            }
        };
        Ok(self.vm.insert(vm))
    }

    fn vm(&mut self) -> Result<&mut Vm> {
        self.vm
            .as_mut()
            .ok_or_else(|| Error::Config("no VM yet: boot or restore one first".into()))
    }

    fn handle(&mut self, req: Request, fds: &mut VecDeque<OwnedFd>) -> Result<Reply> {
        if let Some(preparing) = self.preparing.take() {
            let vm = preparing.join().map_err(|_| {
                Error::Config("creating the VM ahead of time failed; start another process".into())
            })?;
            self.prepared = Some(vm);
        }
        Ok(match req {
            Request::Hello {} => Reply::Hello(Hello {
                protocol: PROTOCOL_VERSION,
                version: env!("CARGO_PKG_VERSION").to_string(),
            }),
            Request::Boot {
                kernel,
                initrd,
                cmdline,
                mem_mib,
                vcpus,
            } => {
                let vm = self.fresh_vm(Shape::new(mem_mib, vcpus))?;
                if let Err(e) = vm.boot_linux(&kernel, initrd.as_deref(), &cmdline) {
                    self.vm = None;
                    return Err(e);
                }
                Reply::State {
                    state: RunState::Running,
                }
            }
            Request::Restore {
                dir,
                slots,
                lazy: true,
            } => {
                let (sent, source) = lazy_request(&dir, &slots, fds)?;
                let id = source.id().to_string();
                let vm = self.fresh_vm(source.shape())?;
                if let Err(e) = vm.restore_lazy(source, &sent).and_then(|_| vm.resume()) {
                    self.vm = None;
                    return Err(e);
                }
                Reply::Restored { id }
            }
            Request::Restore {
                dir,
                slots,
                lazy: false,
            } => {
                let sent = sent_slot_images(&slots, fds)?;
                let image = snapshot::Image::open(&existing_snapshot(&dir)?)?;
                let shape = Shape {
                    mem_size: image.state.meta.mem_size as usize,
                    vcpus: image.state.meta.vcpus,
                };
                let vm = self.fresh_vm(shape)?;
                if let Err(e) = vm
                    .restore_image_with(&image, &sent)
                    .and_then(|_| vm.resume())
                {
                    self.vm = None;
                    return Err(e);
                }
                Reply::Restored {
                    id: image.id().to_string(),
                }
            }
            Request::Pause {} => {
                let vm = self.vm()?;
                vm.pause()?;
                Reply::State { state: vm.state() }
            }
            Request::Resume {} => {
                let vm = self.vm()?;
                vm.resume()?;
                Reply::State { state: vm.state() }
            }
            Request::Snapshot { dir, kind } => {
                Reply::Snapshot(snapshot_op(self.vm()?, &dir, kind)?)
            }
            Request::Rollback { dir } => {
                let vm = self.vm()?;
                let dir = existing_snapshot(&dir).map_err(|e| Error::Rollback(Box::new(e)))?;
                Reply::Rollback(vm.rollback(&dir)?)
            }
            Request::Stats {} => Reply::Stats(self.vm()?.stats()?),
            Request::AttachDisk {
                slot,
                path,
                read_only,
                fd: false,
            } => {
                self.vm()?
                    .attach_disk(slot, &DiskConfig { path, read_only })?;
                Reply::DiskAttached { slot }
            }
            Request::AttachDisk {
                slot,
                path,
                read_only,
                fd: true,
            } => {
                let file = fds.pop_front().map(File::from).ok_or_else(|| {
                    Error::Config(format!(
                        "attach_disk of {} announces a file descriptor but none came with it",
                        path.display()
                    ))
                })?;
                self.vm()?.attach_disk_file(slot, &path, file, read_only)?;
                Reply::DiskAttached { slot }
            }
            Request::DetachDisk { slot } => {
                self.vm()?.detach_disk(slot)?;
                Reply::DiskDetached { slot }
            }
            Request::AttachNet {} => {
                let tap = fds.pop_front().map(File::from).ok_or_else(|| {
                    Error::Net(
                        "attach_net needs the tap's descriptor, and none came with it".into(),
                    )
                })?;
                Reply::NetAttached {
                    tap: self.vm()?.attach_net(tap)?,
                }
            }
            #[cfg(feature = "test-trigger")]
            Request::TestTrigger {} => Reply::Triggered {
                result: crate::jail::forbidden_syscall(),
            },
            Request::Shutdown {} => {
                self.vm = None;
                self.prepared = None;
                Reply::ShutDown {}
            }
        })
    }
}

/// The images sent for a restore's disk slots: one descriptor of `fds` per
/// entry of `slots`, in order. Missing descriptors, or a slot named twice,
/// refuse the request (the descriptors taken are closed).
fn sent_slot_images(
    slots: &[RestoreSlot],
    fds: &mut VecDeque<OwnedFd>,
) -> Result<BTreeMap<usize, SlotImage>> {
    if slots.len() > fds.len() {
        return Err(Error::Config(format!(
            "restore announces {} disk slot images but {} file descriptors came with it",
            slots.len(),
            fds.len()
        )));
    }
    let mut sent = BTreeMap::new();
    for s in slots {
        let file = fds.pop_front().map(File::from).ok_or_else(|| {
            Error::Config("restore: a disk slot image's descriptor is missing".into())
        })?;
        let image = SlotImage {
            name: s.path.clone(),
            file,
        };
        if sent.insert(s.slot, image).is_some() {
            return Err(Error::Config(format!(
                "restore sends two images for disk slot {}",
                s.slot
            )));
        }
    }
    Ok(sent)
}

/// The images and the lazy source of a lazy restore: `slots.len()` slot
/// images, then `/dev/userfaultfd`, then the page server's socket, all
/// checked before any VM is touched (taken descriptors are closed on a
/// refusal).
fn lazy_request(
    dir: &Path,
    slots: &[RestoreSlot],
    fds: &mut VecDeque<OwnedFd>,
) -> Result<(BTreeMap<usize, SlotImage>, LazySource)> {
    if fds.len() < slots.len() + 2 {
        return Err(Error::Config(format!(
            "a lazy restore needs {} file descriptors ({} disk slot images, /dev/userfaultfd, the page server's socket) but {} came with it",
            slots.len() + 2,
            slots.len(),
            fds.len()
        )));
    }
    let sent = sent_slot_images(slots, fds)?;
    let (Some(uffd), Some(sock)) = (fds.pop_front(), fds.pop_front()) else {
        return Err(Error::Config(
            "a lazy restore's descriptors are missing".into(),
        ));
    };
    let source = LazySource::open(
        &existing_snapshot(dir)?,
        &File::from(uffd),
        UnixStream::from(sock),
    )?;
    Ok((sent, source))
}

/// A snapshot; a failure after which the VM still runs as before is
/// [`Error::Refused`].
fn snapshot_op(vm: &mut Vm, dir: &Path, kind: Kind) -> Result<crate::vm::SnapshotInfo> {
    let was = vm.state();
    vm.snapshot(dir, kind).map_err(|e| match e {
        Error::State { .. } | Error::Config(_) => e,
        e if vm.state() == was => Error::Refused {
            op: "snapshot",
            source: Box::new(e),
        },
        e => e,
    })
}

/// Binds the API socket, replacing a stale socket file nobody listens on.
pub fn bind(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::Config(format!(
                "{} is in use by another twig-vmm",
                path.display()
            )));
        }
        std::fs::remove_file(path)
            .map_err(|e| Error::io(format!("removing stale socket {}", path.display()), e))?;
    }
    UnixListener::bind(path).map_err(|e| Error::io(format!("binding {}", path.display()), e))
}
